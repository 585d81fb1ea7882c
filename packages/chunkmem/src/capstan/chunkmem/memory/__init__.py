"""Where chunk payloads live and how they move: the tiers and their exact byte counts (tiers.py), the disk
store (disk.py), eviction policies (eviction.py), the non-model memory a budget follows (nonmodel.py),
copies to and from an accelerator (transfer.py), the device tier above RAM (device.py), the read-ahead
(readahead.py), the disk slots a speculative update is taken back to (rollback.py), the moments and traces
of a step (trace.py), and the manager that places every chunk (manager.py)."""
