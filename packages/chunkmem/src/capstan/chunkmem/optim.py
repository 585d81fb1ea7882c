"""`ChunkAdam`: AdamW over chunks, one chunk group (param, grad, exp_avg, exp_avg_sq) at a time.

Sibling chunks share offsets, so the update runs on whole flat chunks: the
same element-wise operations as `torch.optim.AdamW` (hence the same numbers)
over a few large buffers instead of many small tensors. Chunks on disk are
streamed through the cpu budget in order; with the warm-up trace the manager
reads the next group ahead while this one is updated. Gradients are dropped
after the step (their chunks read as zeros again: that is `zero_grad`).

The update itself is capstan.native's multi-threaded SIMD Adam (which
falls back to torch ops, with one warning, where the library cannot load);
its arithmetic follows torch's element by element (docs/native.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capstan.native import kernels

from .model import ChunkedModel
from .states import ChunkKind

__all__ = ["ChunkAdam", "AdamGroup"]


@dataclass
class AdamGroup:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    step: int = 0


class ChunkAdam:
    """AdamW (decoupled weight decay) for a `ChunkedModel`; one `AdamGroup` per parameter group."""

    def __init__(self, model: ChunkedModel, groups: list[AdamGroup] | None = None, **defaults: object) -> None:
        n = len(model.chunks[ChunkKind.PARAM])
        self.model = model
        self.groups = groups or [AdamGroup(**defaults) for _ in range(n)]  # type: ignore[arg-type]
        if len(self.groups) != n:
            raise ValueError(f"{len(self.groups)} optimizer groups for {n} parameter groups")
        for g in self.groups:
            if g.lr < 0 or g.eps < 0 or not all(0.0 <= b < 1.0 for b in g.betas) or g.weight_decay < 0:
                raise ValueError(f"invalid Adam hyper-parameters: {g}")

    def grad_norm(self) -> float:
        """Global L2 norm of all gradients (one pass over the gradient chunks)."""
        mgr, total = self.model.manager, 0.0
        for g, group in enumerate(self.model.chunks[ChunkKind.GRAD]):
            for i in self.model.owned_indices(g):
                chunk = group[i]
                mgr.access(chunk.chunk_id)
                total += kernels.sumsq(chunk.payload[: chunk.used])  # type: ignore[index]
                mgr.release(chunk.chunk_id)
        return math.sqrt(self.model.reduce_sq(total))

    def step(self, grad_clip: float | None = None) -> float | None:
        """One AdamW step over every chunk group; returns the gradient norm when clipping."""
        mgr = self.model.manager
        scale, norm = 1.0, None
        if grad_clip is not None:
            norm = self.grad_norm()
            if norm > grad_clip:
                scale = grad_clip / (norm + 1e-6)
        chunks = self.model.chunks
        for g, hp in enumerate(self.groups):
            hp.step += 1
            beta1, beta2 = hp.betas
            for i in self.model.owned_indices(g):
                p_chunk = chunks[ChunkKind.PARAM][g][i]
                if p_chunk.used == 0:
                    continue  # padding chunk of a sharded list
                ids = [p_chunk.chunk_id] + [chunks[k][g][i].chunk_id for k in
                                            (ChunkKind.GRAD, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)]
                p, grad, m, v = (mgr.access(cid, write=True).payload for cid in ids)
                n = p_chunk.used
                # AdamW: decoupled weight decay (Loshchilov & Hutter 2019); clipping folded into grad_scale.
                kernels.adam_update(p[:n], grad[:n], m[:n], v[:n], step=hp.step, lr=hp.lr,  # type: ignore[index]
                                    beta1=beta1, beta2=beta2, eps=hp.eps, weight_decay=hp.weight_decay,
                                    adamw=True, grad_scale=scale)
                for cid in ids:
                    mgr.release(cid)
                mgr.free(ids[1])  # gradients are consumed: zero_grad for free
        return norm
