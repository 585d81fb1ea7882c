"""capstan.comm: bootstrap, dp x pp x cp x tp topology, collectives and point-to-point.

Example (runs as one process, or under ``mpirun -np 4`` / ``torchrun --nproc_per_node 4``)::

    import torch
    from capstan import comm

    world = comm.init()                              # reads the launcher's variables
    groups = comm.build_groups(comm.Topology(dp=world.size))
    x = torch.ones(8)
    comm.all_reduce(x, group=groups.dp)              # x == dp size everywhere
    comm.shutdown()
"""

from __future__ import annotations

from .lazy import lazy_attributes

# The package is grouped into rooms by mechanism (docs/comm.md "Layout"): job/ (launch, topology, groups,
# device, world state), backends/ (mpi4py, gloo's ring reduce-scatter), ops/ (collectives, p2p, compression,
# error agreement), health/ (CommError and liveness, fault injection, locks, /proc memory), and at the top
# bootstrap (init/shutdown), log and lazy. Every public name stays reachable as `comm.<name>`.

# Each name's module, imported on first use (lazy.py): importing one torch-free module of this package
# (job.launch_env, what `capstan launch` needs) must not import torch.
_MODULE_NAMES = {
    "ops.agree": ("first_error",),
    "ops.alltoall": ("all_to_all",),
    "bootstrap": ("BACKENDS", "CPU_DEFAULT_BACKEND", "announce_failure", "init", "is_initialized", "shutdown"),
    "ops.bucketing": ("all_reduce_coalesced", "flatten", "plan_buckets", "unflatten"),
    "ops.collectives": (
        "REDUCE_OPS", "CollectiveHandle", "all_gather", "all_reduce", "barrier", "broadcast",
        "progresses_in_background", "reduce", "reduce_scatter", "shard_bounds", "staged",
    ),
    "ops.compress": (
        "INT8_BLOCK", "QuantizedGather", "dequantize_int8", "onebit_all_reduce", "onebit_residual_sizes", "pack_signs",
        "quantize_int8", "quantized_all_gather", "quantized_reduce_scatter", "reset_wire_bytes", "unpack_signs",
        "wire_bytes",
    ),
    "job.accelerator": ("DEVICE_KINDS", "DeviceError", "cuda_report", "pick_device"),
    "health.errors": ("CommError",),
    "job.groups": ("Group", "Groups", "build_groups", "single_process_groups"),
    "job.launch_env": ("LaunchError", "LaunchInfo", "detect_launch"),
    "log": ("get_logger", "log_rank0", "warn_once"),
    "ops.p2p": ("P2PHandle", "P2POp", "exchange", "irecv", "isend", "recv", "send"),
    "job.state": ("backend", "device", "launch", "transport", "world"),
    "job.topology": ("AXES", "Coord", "Topology", "TopologyError"),
}
_LAZY = {name: module for module, names in _MODULE_NAMES.items() for name in names}
__all__ = sorted(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
