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

from .agree import first_error
from .alltoall import all_to_all
from .bootstrap import BACKENDS, CPU_DEFAULT_BACKEND, announce_failure, init, is_initialized, shutdown
from .bucketing import all_reduce_coalesced, flatten, plan_buckets, unflatten
from .collectives import (
    REDUCE_OPS,
    CollectiveHandle,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    progresses_in_background,
    reduce,
    reduce_scatter,
    shard_bounds,
    staged,
)
from .compress import (
    INT8_BLOCK,
    QuantizedGather,
    dequantize_int8,
    onebit_all_reduce,
    onebit_residual_sizes,
    pack_signs,
    quantize_int8,
    quantized_all_gather,
    quantized_reduce_scatter,
    reset_wire_bytes,
    unpack_signs,
    wire_bytes,
)
from .device import DEVICE_KINDS, DeviceError, cuda_report, pick_device
from .errors import CommError
from .groups import Group, Groups, build_groups, single_process_groups
from .launch_env import LaunchError, LaunchInfo, detect_launch
from .log import get_logger, log_rank0, warn_once
from .p2p import P2PHandle, P2POp, exchange, irecv, isend, recv, send
from .state import backend, device, launch, transport, world
from .topology import AXES, Coord, Topology, TopologyError

__all__ = [
    "INT8_BLOCK", "QuantizedGather", "dequantize_int8", "onebit_all_reduce", "onebit_residual_sizes", "pack_signs",
    "quantize_int8", "quantized_all_gather", "quantized_reduce_scatter", "reset_wire_bytes", "unpack_signs",
    "wire_bytes",
    "AXES", "BACKENDS", "CPU_DEFAULT_BACKEND", "CollectiveHandle", "CommError", "Coord", "DEVICE_KINDS",
    "DeviceError", "Group", "Groups", "LaunchError", "cuda_report", "device", "pick_device", "staged", "transport",
    "LaunchInfo", "P2PHandle", "P2POp", "REDUCE_OPS", "Topology", "TopologyError", "all_gather", "all_to_all",
    "all_reduce", "all_reduce_coalesced", "announce_failure", "backend", "barrier", "broadcast", "build_groups",
    "detect_launch", "exchange", "first_error", "flatten", "get_logger", "init", "irecv", "is_initialized", "isend",
    "launch", "log_rank0", "plan_buckets", "progresses_in_background", "recv", "reduce", "reduce_scatter", "send",
    "shard_bounds", "shutdown", "single_process_groups", "unflatten", "warn_once", "world",
]
