"""Mixed precision: the autocast context and the fp16 dynamic loss scaler.

Master weights and optimizer state stay fp32 unless precision.master_weights or
precision.optimizer_states say otherwise; bf16/fp16 change the dtype of the
forward/backward computation (`torch.autocast`).
fp16 needs loss scaling (Micikevicius et al. 2018, section 3.2): the loss is
multiplied by `scale` before backward so small gradients survive fp16, the
optimizer divides it out, and a step whose gradients hold inf/NaN is skipped.
"""

from __future__ import annotations

import contextlib

import torch

from capstan.chunkmem.optim.precision import DynamicLossScaler

from .config.schema import PrecisionConfig

__all__ = ["loss_scaler", "autocast", "moment_dtype", "master_dtype"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(p: PrecisionConfig, device: str = "cpu") -> contextlib.AbstractContextManager:
    if p.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=_DTYPES[p.dtype])


def moment_dtype(config: object) -> torch.dtype:
    """The dtype of Adam's moments (`precision.optimizer_states`) for the flat buffers and the chunks:
    torch.uint8 stands for 8-bit block-wise codes (capstan.native.q8)."""
    states = config.precision.optimizer_states  # type: ignore[attr-defined]
    return {"bf16": torch.bfloat16, "int8": torch.uint8}.get(states, torch.float32)


def master_dtype(config: object) -> torch.dtype:
    """The dtype of the optimizer's master weights (`precision.master_weights`), in chunks and in the flat
    ZeRO 0-2 buffer alike."""
    return torch.bfloat16 if config.precision.master_weights == "bf16" else torch.float32  # type: ignore[attr-defined]


def loss_scaler(p: PrecisionConfig) -> DynamicLossScaler:
    """The fp16 dynamic loss scaler configured by `[precision]` (one implementation, in chunkmem)."""
    return DynamicLossScaler(initial_scale=p.initial_scale, window=p.window, hysteresis=p.hysteresis,
                             min_scale=p.min_scale, raise_at_min_scale=p.raise_at_min_scale)
