"""`OneBitChunkAdam`: 1-bit Adam (Tang et al. 2021) over a `ReplicatedChunkedModel`'s chunks.

The algorithm is the engine's flat-buffer one (engine/zero/compression.py)
done chunk group by chunk group, so it works where the states live in RAM
and on disk:

* the first `freeze_steps` steps are exact AdamW: the gradient chunks are
  averaged over the group (`ReplicatedChunkedModel.reduce_gradients`, once
  per step, before the norm or the step reads them) and `ChunkAdam` steps;
* afterwards the gradients stay on their rank. For each chunk group the
  momentum takes this rank's gradient, `comm.onebit_all_reduce` averages
  it in one bit with the group's worker and server residual chunks (error
  feedback), and the parameters step with it over the variance frozen at
  the freeze (`frozen_variance_step`). Every rank ends with the same
  momentum and parameters. The scales are per chunk (the flat buffer's are
  per tp region): chunk lists never mix tp-sliced and replicated
  parameters, so a replicated chunk's scale is the same on every tp rank.
  Gradient clipping uses the root mean square of the ranks' own gradient
  norms and an overflow on any rank skips the step on all (as the flat
  optimizer does).

The all-reduce's buffers are reserved in the cpu tier while it runs
(`onebit_scratch_bytes`), and the model's minimum budget counts them.
"""

from __future__ import annotations

import math

import torch

from capstan import comm
from capstan.native import kernels

from ..model.states import ChunkKind
from ..parallel.replicated import ReplicatedChunkedModel, onebit_scratch_bytes
from .adam import AdamGroup, ChunkAdam

__all__ = ["OneBitChunkAdam", "compressed_momentum", "frozen_variance_step"]


def compressed_momentum(exp_avg: torch.Tensor, grad: torch.Tensor, worker: torch.Tensor, server: torch.Tensor,
                        group: comm.Group, *, beta1: float, grad_scale: float) -> None:
    """1-bit Adam's momentum past its freeze, the one place its math lives (the engine's flat buffers and
    the chunks here both call it): this rank's m = beta1 m + (1 - beta1) g with its *own* gradient (times
    `grad_scale`: 1/loss scale and the clip), then every rank's m replaced by their 1-bit average, with
    error feedback through this rank's `worker` and `server` residuals (comm.onebit_all_reduce)."""
    exp_avg.mul_(beta1).add_(grad, alpha=(1.0 - beta1) * grad_scale)
    comm.onebit_all_reduce(exp_avg, worker, server, group=group)


def frozen_variance_step(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
                         freeze_steps: int, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float) -> None:
    """AdamW's update of `param` with the (averaged) momentum `exp_avg` and the variance `exp_avg_sq` frozen
    after `freeze_steps` steps: the momentum's bias correction is this `step`'s, the variance's that of
    the step that froze it (1-bit Adam's compressed phase)."""
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    denom = exp_avg_sq.sqrt().div_((1.0 - beta2 ** freeze_steps) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / (1.0 - beta1 ** step)))


class OneBitChunkAdam(ChunkAdam):
    """1-bit Adam for a `ReplicatedChunkedModel(..., onebit=True)` (module docstring)."""

    def __init__(self, model: ReplicatedChunkedModel, groups: list[AdamGroup] | None = None,
                 freeze_steps: int = 0, **defaults: object) -> None:
        if not getattr(model, "onebit", False):
            raise ValueError("OneBitChunkAdam needs a ReplicatedChunkedModel(..., onebit=True): its residual chunks")
        if freeze_steps < 0:
            raise ValueError(f"freeze_steps must be >= 0, got {freeze_steps}")
        if model.moment_dtype != torch.float32:
            raise ValueError(f"OneBitChunkAdam keeps fp32 moments (its compressed step is its own arithmetic); "
                             f"the model's moment chunks are {model.moment_dtype}")
        if model.bf16_master:  # its step past the freeze updates the master with torch ops: nearest rounding
            raise ValueError("OneBitChunkAdam keeps an fp32 master (its compressed step rounds to nearest and "
                             "averages gradients in fp32): build the model with master_dtype=torch.float32")
        super().__init__(model, groups, **defaults)
        self.model: ReplicatedChunkedModel = model
        self.freeze_steps = freeze_steps
        self._reduced = False  # this step's gradients already averaged over the group
        self._residuals = {f"onebit.{key}.{g}.{i}": (chunk.chunk_id, chunk.capacity)
                           for kind, key in ((ChunkKind.ONEBIT_WORKER, "worker"), (ChunkKind.ONEBIT_SERVER, "server"))
                           for g, lst in enumerate(model.chunks[kind]) for i, chunk in enumerate(lst)}

    @property
    def compressing(self) -> bool:
        """True once `freeze_steps` exact steps are behind: the next step averages the momentum in 1 bit."""
        return self.groups[0].step >= self.freeze_steps

    def _reduce(self) -> None:
        """The exact phase's gradient average, once per step, before anything reads the gradients."""
        if not self._reduced and not self.compressing:
            self.model.reduce_gradients()
        self._reduced = True

    def grad_norm(self) -> float:
        self._reduce()
        if not self.compressing:
            return super().grad_norm()
        local = torch.tensor([self._weighted_sumsq()], dtype=torch.float64)
        comm.all_reduce(local, op="avg", group=self.model.group)  # the ranks' own norms: root mean square
        return math.sqrt(self.model.reduce_sq(float(local.item())))

    def has_overflow(self) -> bool:
        self._reduce()
        flag = self._local_overflow()
        if self.compressing:  # the gradients were not averaged: an overflow on one rank is its own
            t = torch.tensor([1.0 if flag else 0.0])
            comm.all_reduce(t, op="max", group=self.model.group)
            flag = bool(t.item())
        return self.model.reduce_any(flag)

    def _plain_step(self, grad_clip: float | None, loss_scale: float,
                    check_overflow: bool) -> tuple[float | None, bool]:
        self._reduce()
        return super()._plain_step(grad_clip, loss_scale, check_overflow)

    def _drop_grads(self) -> None:
        super()._drop_grads()
        self._reduced = False

    def _update(self, unscale: float, skip: set[tuple[int, int]] | frozenset = frozenset()) -> None:
        if not self.compressing:
            super()._update(unscale, skip)
            return
        mgr, chunks, mixed = self.model.manager, self.model.chunks, self.model.mixed
        group = self.model.group
        master_kind = ChunkKind.MASTER if mixed else ChunkKind.PARAM
        kinds = (master_kind, ChunkKind.GRAD, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ, ChunkKind.ONEBIT_WORKER,
                 ChunkKind.ONEBIT_SERVER)
        for g, hp, i, p_chunk, n in self._chunk_groups():
            beta1, beta2 = hp.betas
            worker_n, server_n = comm.onebit_residual_sizes(n, group.size)
            ids = [chunks[k][g][i].chunk_id for k in kinds]
            # The frozen variance is only read: its copy on disk stays current and is not written back.
            master, grad, m, v, worker, server = (mgr.access(cid, write=k is not ChunkKind.EXP_AVG_SQ).payload
                                                  for k, cid in zip(kinds, ids))  # type: ignore[union-attr]
            m = m[:n]
            scratch = onebit_scratch_bytes(n, group.size)
            mgr.reserve_transient(scratch, f"1-bit all-reduce of chunk group ({g}, {i})")
            try:
                compressed_momentum(m, grad[:n], worker[:worker_n], server[:server_n], group, beta1=beta1,
                                    grad_scale=unscale)
            finally:
                mgr.release_transient(scratch)
            frozen_variance_step(master[:n], m, v[:n], step=hp.step, freeze_steps=self.freeze_steps, lr=hp.lr,
                                 beta1=beta1, beta2=beta2, eps=hp.eps, weight_decay=hp.weight_decay)
            if mixed:  # the 16-bit parameter the modules compute with
                out = mgr.access(p_chunk.chunk_id, write=True).payload[:n]  # type: ignore[index]
                kernels.cast_(master[:n], out)
                mgr.release(p_chunk.chunk_id)
            for cid in ids:
                mgr.release(cid)

    def state_chunks(self) -> dict[str, tuple[int, int]]:
        """This rank's residual chunks by checkpoint key: (chunk id, elements)."""
        return dict(self._residuals)

    def read_state(self, key: str) -> torch.Tensor:
        """A copy of residual `key` (`state_chunks`) in RAM."""
        cid, _ = self._residuals[key]
        with self.model.manager.off_trace():  # between steps (a checkpoint): not moments of the next one
            chunk = self.model.manager.access(cid)
        try:
            return chunk.payload.to("cpu", copy=True)  # type: ignore[union-attr]
        finally:
            self.model.manager.release(cid)

    def write_state(self, key: str, value: torch.Tensor) -> None:
        """Set residual `key` from `value` (its capacity of fp32 elements)."""
        cid, numel = self._residuals[key]
        if value.numel() != numel:
            raise ValueError(f"{key}: {value.numel()} elements, expected {numel}")
        with self.model.manager.off_trace():  # between steps (a resume): not moments of the next one
            chunk = self.model.manager.access(cid, overwrite=True)
        try:
            chunk.payload.copy_(value.reshape(-1))  # type: ignore[union-attr]
        finally:
            self.model.manager.release(cid)
