"""What keeps a job honest about failure and about this host: CommError and the liveness records that
name a lost peer (errors), fault injection for the crash tests (faults), one process per run directory
(lockfile), memory read from /proc and whether a process is alive (procmem).

Imports only `job`: the operations depend on it, never the other way round.
"""
