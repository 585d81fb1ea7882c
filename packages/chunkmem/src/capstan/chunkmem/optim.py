"""`ChunkAdam`: AdamW over chunks, one chunk group (param, grad, exp_avg, exp_avg_sq) at a time.

Sibling chunks share offsets, so the update runs on whole flat chunks: the
same element-wise operations as `torch.optim.AdamW` (hence the same numbers)
over a few large buffers instead of many small tensors. Chunks on disk are
streamed through the cpu budget in order; with the warm-up trace the manager
reads the next group ahead while this one is updated. Gradients are dropped
after the step (their chunks read as zeros again: that is `zero_grad`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
        for group in self.model.chunks[ChunkKind.GRAD]:
            for chunk in group:
                mgr.access(chunk.chunk_id)
                total += float(chunk.payload.double().pow(2).sum())  # type: ignore[union-attr]
                mgr.release(chunk.chunk_id)
        return math.sqrt(total)

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
            bc1 = 1 - beta1 ** hp.step
            bc2_sqrt = math.sqrt(1 - beta2 ** hp.step)
            step_size = hp.lr / bc1
            for i, p_chunk in enumerate(chunks[ChunkKind.PARAM][g]):
                ids = [p_chunk.chunk_id] + [chunks[k][g][i].chunk_id for k in
                                            (ChunkKind.GRAD, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)]
                p, grad, m, v = (mgr.access(cid, write=True).payload for cid in ids)
                n = p_chunk.used
                p, grad, m, v = p[:n], grad[:n], m[:n], v[:n]  # type: ignore[index]
                if scale != 1.0:
                    grad.mul_(scale)
                # torch.optim.AdamW's element-wise sequence (decoupled decay, Loshchilov & Hutter 2019).
                p.mul_(1 - hp.lr * hp.weight_decay)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v.sqrt() / bc2_sqrt).add_(hp.eps)
                p.addcdiv_(m, denom, value=-step_size)
                for cid in ids:
                    mgr.release(cid)
                mgr.free(ids[1])  # gradients are consumed: zero_grad for free
        return norm
