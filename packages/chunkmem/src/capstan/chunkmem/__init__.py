"""capstan.chunkmem: chunk-based heterogeneous memory (PatrickStar-style) with a disk tier.

Parameters, gradients and Adam moments live in fixed-size chunks that move
between the cpu tier (an exact byte budget) and a disk tier, driven by the
access trace of a warm-up step (furthest-next-use eviction, prefetch).

    manager = ChunkManager(cpu_budget=64 << 20, disk=DiskStore("/tmp/chunks"))
    model = ChunkedModel(net, manager, chunk_size=1 << 20)
    opt = ChunkAdam(model, lr=1e-3)
    for x, y in data:
        manager.begin_step()
        loss = loss_fn(model(x), y)
        model.backward(loss)
        opt.step()
        manager.end_step()

`ShardedChunkedModel(net, manager, chunk_size, group=groups.dp)` shards the
chunks over a data-parallel group (ZeRO-3 through chunks).

`ReplicatedChunkedModel(net, manager, chunk_size, group=groups.dp, onebit=True)` with
`OneBitChunkAdam(model, freeze_steps=K)` keeps every chunk on every rank and
trains with 1-bit Adam, its error-feedback residuals in chunks (onebit.py).

`ChunkedModel(..., dtype=torch.bfloat16)` keeps 16-bit parameters with fp32
masters; without gradient accumulation a gradient reuses its parameter's
16-bit slot (14 bytes per parameter).

`ChunkedModel(..., order="trace", example_inputs=(x,))` packs parameters in
the order one traced forward first uses their modules (order.py) instead of
creation order.

`ChunkManager(..., device="cuda", device_budget=N)` adds a compute-device tier
above RAM (device.py): parameter and gradient chunks compute there, the
optimizer's chunks stay in RAM and on disk. Tested with a CPU stand-in
device; never run on a GPU (see docs/chunkmem.md).
"""

from .activations import ActivationOffload
from .memory.disk import DiskStore, DiskTierError
from .memory.eviction import LRU, Belady, EvictionPolicy, make_policy
from .memory.manager import BudgetError, ChunkManager
from .memory.tiers import Tier
from .model.chunk import Chunk, TensorSlot
from .model.chunked import ChunkedModel
from .model.layout import (
                     LayoutError,
                     ModuleSpec,
                     ParamSpec,
                     auto_chunk_size,
                     group_lists,
                     list_capacity,
                     packed_lists,
                     plan_layout,
                     search_chunk_size,
                     split_list_ends,
                     utilization,
)
from .model.states import ChunkKind, ChunkState, StateError, TensorState
from .optim.adam import AdamGroup, ChunkAdam
from .optim.onebit import OneBitChunkAdam, frozen_variance_step
from .optim.precision import DynamicLossScaler, LossScaleError
from .parallel.replicated import ReplicatedChunkedModel
from .parallel.sharding import ShardedChunkedModel

__all__ = [
    "ActivationOffload", "AdamGroup", "Belady", "BudgetError", "Chunk", "ChunkAdam", "ChunkKind", "ChunkManager",
    "ChunkState", "ChunkedModel", "DiskStore", "DynamicLossScaler", "DiskTierError", "EvictionPolicy", "LRU",
    "LayoutError",
    "LossScaleError", "ModuleSpec", "OneBitChunkAdam",
    "ParamSpec", "ReplicatedChunkedModel", "ShardedChunkedModel", "StateError", "TensorSlot", "TensorState", "Tier",
    "make_policy", "plan_layout",
    "auto_chunk_size", "frozen_variance_step", "list_capacity", "group_lists", "packed_lists", "split_list_ends",
    "search_chunk_size", "utilization",
]
