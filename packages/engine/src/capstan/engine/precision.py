"""Mixed precision: the autocast context and the fp16 dynamic loss scaler.

Master weights and optimizer state stay fp32 in every mode; bf16/fp16 only
change the dtype of the forward/backward computation (`torch.autocast`).
fp16 needs loss scaling (Micikevicius et al. 2018, section 3.2): the loss is
multiplied by `scale` before backward so small gradients survive fp16, the
optimizer divides it out, and a step whose gradients hold inf/NaN is skipped.
"""

from __future__ import annotations

import contextlib

import torch

from .config import PrecisionConfig

__all__ = ["LossScaler", "autocast"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(p: PrecisionConfig, device: str = "cpu") -> contextlib.AbstractContextManager:
    if p.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=_DTYPES[p.dtype])


class LossScaler:
    """Dynamic loss scale (the DeepSpeed / Megatron scheme with hysteresis).

    After `window` overflow-free steps the scale doubles; an overflow skips
    the step, and the `hysteresis`-th overflow since the last change halves the
    scale (never below `min_scale`).
    """

    def __init__(self, p: PrecisionConfig) -> None:
        self.scale = float(p.initial_scale)
        self.window, self.hysteresis, self.min_scale = p.window, p.hysteresis, p.min_scale
        self.good_steps = 0
        self.overflows_left = p.hysteresis
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2.0
            self.good_steps = 0
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows_left": self.overflows_left,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.overflows_left = int(state["overflows_left"])
        self.skipped_steps = int(state["skipped_steps"])
