"""Learning-rate schedule: linear warmup, then cosine / linear decay to min_lr, or constant.

    lr_at(train_cfg, step)   # step counts optimizer steps from 0
"""

from __future__ import annotations

import math

from .config.schema import TrainConfig

__all__ = ["lr_at"]


def lr_at(t: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    if step < t.warmup_steps:
        # Linear warmup from lr / warmup_steps (never 0: a zero-lr first step would be wasted).
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    span = max(1, t.steps - t.warmup_steps - 1)
    progress = min(1.0, (step - t.warmup_steps) / span)
    if t.lr_schedule == "linear":
        return t.lr - (t.lr - t.min_lr) * progress
    # Cosine decay (Loshchilov & Hutter 2017, SGDR eq. 5, one cycle without restarts).
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))
