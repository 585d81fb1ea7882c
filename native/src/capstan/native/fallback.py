"""Pure-torch versions of every libcapstan kernel.

Used when the library cannot be loaded (one warning, from `_lib.get`) and as
the reference the tests compare the native kernels with. Each function takes
already-validated arguments (see `kernels.py`) and follows the native kernel's
order of floating-point operations, so the two agree to the last bit for the
element-wise kernels.
"""

from __future__ import annotations

import torch

__all__ = ["adam_step", "cast_", "copy_", "sum_", "sumsq", "has_nonfinite"]


def has_nonfinite(x: torch.Tensor, scale: float = 1.0) -> bool:
    y = x.float()
    if scale != 1.0:
        y = y * scale
    return not bool(torch.isfinite(y).all())


@torch.no_grad()
def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, adamw: bool, grad_scale: float = 1.0,
              check_overflow: bool = False, out: torch.Tensor | None = None) -> bool:
    """Same contract as capstan_adam_step: returns True (and changes nothing) on overflow."""
    f32 = torch.float32
    scale = torch.tensor(grad_scale, dtype=f32)  # the kernel multiplies by float(grad_scale)
    if check_overflow and has_nonfinite(grad, float(scale)):
        return True
    g = grad.to(f32)
    if grad_scale != 1.0:
        g = g * scale
    # The ATen ops torch.optim's single-tensor Adam uses, in its order
    # (torch/optim/adam.py, _single_tensor_adam); the native kernel mirrors
    # their roundings, fused multiply-adds included.
    if weight_decay != 0.0:
        if adamw:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / (1.0 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / (1.0 - beta1**step)))
    if out is not None:
        out.copy_(param)
    return False


def cast_(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def sum_(srcs: list[torch.Tensor], out: torch.Tensor) -> None:
    acc = srcs[0].to(torch.float32)
    for s in srcs[1:]:
        acc = acc + s.to(torch.float32)
    out.copy_(acc)


def sumsq(x: torch.Tensor) -> float:
    return float(x.to(torch.float64).square().sum())
