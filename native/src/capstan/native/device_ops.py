"""The kernels' contract on a CUDA device, through torch's own kernels.

`kernels.py` validates the arguments and sends tensors that live on a GPU
here, so an optimizer whose flat buffers sit on the GPU (capstan.engine's
ZeRO 0-2 without offload) calls the same functions as one on the CPU.

Adam/AdamW is `torch._fused_adamw_` / `torch._fused_adam_` (one kernel over
the whole buffer, what ``torch.optim.AdamW(fused=True)`` runs) where this
torch has it for the device and the parameter, gradient and moments are all
fp32; otherwise `fallback.adam_step`, the op-by-op form of the CPU kernel
(bf16 moments and a bf16 master round stochastically, which the fused kernel
does not). The fused
kernel's arithmetic is the textbook update, so the results match the CPU
kernel to rounding (the GPU parity tests allow 1e-4 relative on the loss),
not bit for bit. It divides the gradient by the scale tensor it is given and
stores the divided value back, so on a GPU `grad` holds ``grad * grad_scale``
after the call: callers consume gradients with the step.

Every function here also runs on CPU tensors (torch's fused Adam has a CPU
kernel too), which is how the tests check this path on a machine without a GPU.
"""

from __future__ import annotations

import torch

from . import fallback

__all__ = ["adam_step", "adam_step_fused", "sumsq", "sumsq_tensor", "fused_available"]


def fused_available(device: torch.device) -> bool:
    # "standin": the CPU suite's stand-in accelerator runs the CPU's fused kernel on its host memory
    return hasattr(torch, "_fused_adamw_") and device.type in ("cuda", "cpu", "standin")


_SCALARS: dict[tuple[torch.device, str], torch.Tensor] = {}


def _scalar(device: torch.device, role: str, value: float) -> torch.Tensor:
    """A one-element fp32 tensor on `device` holding `value`, kept per device and role and refilled: the
    fused kernels read the step and the scale from device tensors, and a new ``torch.tensor(v, device=)``
    per call is a copy from pageable host memory (a host sync) per segment per step; ``fill_`` passes the
    value as a kernel argument instead. Reuse is safe: every use is in the device's stream order."""
    t = _SCALARS.get((device, role))
    if t is None:
        t = _SCALARS[(device, role)] = torch.empty((), dtype=torch.float32, device=device)
    return t.fill_(value)


@torch.no_grad()
def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
              grad_scale: float = 1.0, check_overflow: bool = False, out: torch.Tensor | None = None,
              seed: int = 0, index_base: int = 0) -> bool:
    """Same contract as `kernels.adam_update` (returns True and changes nothing on overflow), except
    that with the fused kernel `grad` is left scaled (see the module docstring). bf16 moments take the
    op-by-op form (fallback.py, a window at a time), whose random words are the CPU kernel's; on a CUDA
    device its fp32 arithmetic is not bit for bit the CPU's (CUDA fuses addcmul_ and addcdiv_ as
    fma(value, b * c, a), the CPU as fma(value * b, c, a): about 4% of parameters an ulp apart)."""
    if check_overflow and fallback.has_nonfinite(grad, grad_scale):
        return True
    # torch's fused kernels round a bf16 param to nearest: a bf16 master takes the op-by-op form, whose
    # stochastic rounding is the CPU kernel's.
    if (param.dtype != torch.float32 or grad.dtype != param.dtype or exp_avg.dtype != param.dtype
            or not fused_available(param.device)):
        fallback.adam_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, out=out, seed=seed,
                           index_base=index_base)
        return False
    dev = param.device
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    # The fused kernels read the step count from a tensor on the device and divide by grad_scale.
    steps = [_scalar(dev, "step", float(step))]
    scale = None if grad_scale == 1.0 else _scalar(dev, "scale", 1.0 / grad_scale)
    kernel([param], [grad], [exp_avg], [exp_avg_sq], [], steps, lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
    if out is not None and out.data_ptr() != param.data_ptr():
        out.copy_(param)
    return False


@torch.no_grad()
def adam_step_fused(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, adamw: bool, grad_scale: float = 1.0) -> None:
    """`adam_step`'s fused kernel over lists of fp32 tensors on one device that share the hyper-parameters,
    in one multi-tensor call: the ZeRO optimizer's pieces of one flat buffer with the same weight decay,
    where a call per piece costs its launches and their host work each (a GPU step is bound by the host).
    The caller checked what `kernels.adam_update` checks and that `fused_available`; the gradients are
    left multiplied by `grad_scale`, as `adam_step` leaves them."""
    if not params:
        return
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError(f"adam_step_fused takes lists of one length, got {len(params)}, {len(grads)}, "
                         f"{len(exp_avgs)} and {len(exp_avg_sqs)}")
    dev = params[0].device
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    steps = [_scalar(dev, "step", float(step))] * len(params)  # (read by the kernel, never written)
    scale = None if grad_scale == 1.0 else _scalar(dev, "scale", 1.0 / grad_scale)
    kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)


def sumsq(x: torch.Tensor) -> float:
    """Squared L2 norm: `sumsq_tensor`, read by the host."""
    if x.numel() == 0:
        return 0.0
    return float(sumsq_tensor(x))


NORM_ROW = 4096  # elements summed in fp32 before the sums go on in float64 (sumsq_tensor)


def nonfinite_tensor(x: torch.Tensor) -> torch.Tensor:
    """Whether `x` holds inf/NaN, as a 0-dim bool tensor left on its device: from `sumsq_tensor`'s row norms,
    so no temporary the size of `x` (`torch.isfinite(x).all()` makes a bool per element, 1.3 GB for a
    1.3B-element shard at the step's peak, and a 16-bit `x` went through an fp32 copy first). A norm is
    inf/NaN exactly when an element is, but for finite values past 1.8e19, whose square fp32 cannot hold:
    those count too (no gradient under a loss scale is worth stepping with them)."""
    return ~torch.isfinite(sumsq_tensor(x))


def sumsq_tensor(x: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm left on `x`'s device as a 0-dim float64 tensor (a norm summed over segments reads
    the host once, not once per segment): the norms of rows of NORM_ROW elements in fp32 (one reduction
    kernel, the tail one more), then the norm of those in float64. A row's fp32 sum is good to about 1e-6
    on the CPU's kernels (their lanes add a row's 512 elements in order) and better on CUDA's; the float64
    sum over rows keeps that bound for any length (a whole 1M-element tensor in fp32 was 2e-5 off).

    Not `vector_norm(x, dtype=torch.float64)`: ATen converts a reduction's whole input to the accumulation
    dtype before reducing (make_reduction; only 16-bit inputs to fp32 are widened inside the kernel on
    CUDA), so that made a float64 copy of every gradient segment, 8 bytes an element on the device at the
    step's peak: 10 GB for a 1.3B-element flat shard, and as much written and read again."""
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    flat = x.reshape(-1)
    if flat.dtype != torch.float32 and flat.device.type != "cuda":  # (CUDA widens 16-bit inputs in the kernel)
        flat = flat.float()
    whole = n - n % NORM_ROW
    parts = []
    if whole:
        parts.append(torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), 2, dim=1, dtype=torch.float32))
    if whole < n:
        parts.append(torch.linalg.vector_norm(flat[whole:], 2, dtype=torch.float32).reshape(1))
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    return torch.linalg.vector_norm(rows, 2, dtype=torch.float64).square()
