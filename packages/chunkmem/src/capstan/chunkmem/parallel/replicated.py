"""Data parallelism over replicated chunks (ZeRO 0 through chunks), for 1-bit Adam.

`ShardedChunkedModel` is what chunks do at dp > 1: each rank owns 1/N of
them, which saves memory and costs the same gradient traffic as an
all-reduce. 1-bit Adam (Tang et al. 2021) cannot shard: every rank updates
the *whole* momentum from its own gradient and the momenta are averaged in
one bit, so each rank needs every element of the momentum and the
parameters. `ReplicatedChunkedModel` keeps a full copy of every chunk on
every rank of `group` (the chunk manager still places them between the
device, RAM and disk within its budgets, which is the point: a model whose
states do not fit in RAM trains with 1-bit Adam over a slow network):

* gradients land in fp32 GRAD chunks (16-bit slot reuse would all-reduce
  16-bit sums), and `reduce_gradients` averages them over `group`, chunk by
  chunk, for the exact steps;
* with ``onebit=True`` every chunk group has two more sibling chunks, the
  worker and server error-feedback residuals of `comm.onebit_all_reduce`
  (ChunkKind.ONEBIT_WORKER / ONEBIT_SERVER, zeros at the start). They are
  this rank's own state: they move between tiers and count in the budget
  like the moments, and checkpoints keep them per rank.

`OneBitChunkAdam` (onebit.py) is the optimizer that uses them.
"""

from __future__ import annotations

from torch import nn

from capstan import comm
from capstan.comm import Group

from ..memory.manager import ChunkManager
from ..model.chunked import ChunkedModel
from ..model.states import ChunkKind

__all__ = ["ReplicatedChunkedModel", "ONEBIT_KINDS", "onebit_scratch_bytes"]

ONEBIT_KINDS = (ChunkKind.ONEBIT_WORKER, ChunkKind.ONEBIT_SERVER)


def onebit_scratch_bytes(numel: int, world: int) -> int:
    """A bound of the buffers `comm.onebit_all_reduce` of `numel` fp32 elements over `world` ranks holds at
    once beyond its arguments: one fp32 unpacking of the signs (4 bytes per padded element; the scaling
    and the averages are in place or a part's size) and the int64 byte indices it is looked up by (1),
    the byte masks of packing (1, not at the same time), the packed and exchanged signs (~0.4)."""
    padded, _ = comm.onebit_residual_sizes(numel, world)
    return 6 * padded + 64 * world


class ReplicatedChunkedModel(ChunkedModel):
    """A `ChunkedModel` replicated on every rank of the data-parallel group `group` (module docstring);
    `onebit` adds 1-bit Adam's residual chunks."""

    def __init__(self, module: nn.Module, manager: ChunkManager, chunk_size: int | None, group: Group,
                 onebit: bool = False, **kwargs: object) -> None:
        self.group, self.onebit = group, onebit
        super().__init__(module, manager, chunk_size, **kwargs)  # type: ignore[arg-type]

    def _needs_grad_chunks(self) -> bool:
        return True  # averaged over the group in fp32

    def kinds(self) -> list[ChunkKind]:
        return super().kinds() + (list(ONEBIT_KINDS) if self.onebit else [])

    def _state_capacities(self, size: int) -> dict[ChunkKind, int]:
        if not self.onebit:
            return {}
        worker, server = comm.onebit_residual_sizes(size, self.group.size)
        return {ChunkKind.ONEBIT_WORKER: worker, ChunkKind.ONEBIT_SERVER: server}

    def _optimizer_need(self) -> tuple[int, str]:
        """A 1-bit step holds a chunk group and the compressed all-reduce's buffers (reserved as transient
        bytes while it runs)."""
        need, what = super()._optimizer_need()
        if self.onebit:
            widest = max((lst[0].capacity for lst in self.chunks[ChunkKind.PARAM] if lst), default=0)
            need += onebit_scratch_bytes(widest, self.group.size)
            what = "one 1-bit Adam step over a chunk group (its chunks and the 1-bit all-reduce's buffers)"
        return need, what

    def reduce_gradients(self) -> None:
        """Average every gradient chunk over `group`, in place (same order on every rank: list order)."""
        mgr = self.manager
        for lst in self.chunks[ChunkKind.GRAD]:
            for chunk in lst:
                n = chunk.used
                if n == 0:
                    continue
                mgr.access(chunk.chunk_id, write=True)
                try:
                    comm.all_reduce(chunk.payload[:n], op="avg", group=self.group)  # type: ignore[index]
                finally:
                    mgr.release(chunk.chunk_id)
