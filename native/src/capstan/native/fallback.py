"""Pure-torch versions of every libcapstan kernel.

Used when the library cannot be loaded (one warning, from `_lib.get`) and as
the reference the tests compare the native kernels with. Each function takes
already-validated arguments (see `kernels.py`) and follows the native kernel's
order of floating-point operations, so the two agree to the last bit for the
element-wise kernels on the CPU. On a GPU (device_ops.py runs these for bf16 and
8-bit moments) the random words are the same, but CUDA's addcmul_/addcdiv_ fuse
differently from the CPU's, so a parameter may land an ulp apart.
"""

from __future__ import annotations

import torch

from .q8 import Q8_EXP_AVG, Q8_EXP_AVG_SQ, per_element, q8_decode, q8_encode, q8_inverse, q8_scale

__all__ = ["adam_step", "adam_step_q8", "cast_", "copy_", "sum_", "sumsq", "has_nonfinite", "sr_key", "sr_key_param",
           "to_bf16_sr"]

_M32 = 0xFFFFFFFF
# Elements per pass of `adam_step` and `adam_step_q8`. A pass's temporaries (fp32 copies, int64 hashes)
# come to about 80 bytes an element (measured on the stand-in device: 65 with bf16 moments, 73 with a bf16
# master too, 81 with 8-bit moments), which on a GPU, where these run on the device, was 84 GB for one
# 1.3B-element flat shard. In windows they stay under WINDOW_BYTES whatever the tensor's size; each
# element keeps its index, so the bits are the same.
WINDOW = 1 << 22
WINDOW_BYTES = 96 * WINDOW  # what the planner counts for one pass's temporaries (plan/memory.py)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """capstan::sr_hash on int64 tensors holding 32-bit values (each product masked back to 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _hash_int(x: int) -> int:
    return int(_hash32(torch.tensor([x & _M32], dtype=torch.int64))[0])


def sr_key(seed: int) -> int:
    """The hash stream the native kernel derives from a 64-bit seed for the moments' rounding: element i
    draws the word _hash32(key + i), its top 16 bits for exp_avg and its low 16 for exp_avg_sq."""
    return _hash_int((seed & _M32) ^ _hash_int(seed >> 32))


def sr_key_param(seed: int) -> int:
    """The hash stream of a bf16 parameter's rounding (AdamArgs::key_p): the moments' key hashed once
    more, so its words are not the moments'; it rounds with the top half ("hi") of its element's word."""
    return _hash_int(sr_key(seed) ^ 0x9E3779B9)


def to_bf16_sr(x: torch.Tensor, key: int, index_base: int = 0, half: str = "hi") -> torch.Tensor:
    """capstan::f32_to_bf16_sr of every element of fp32 `x` (index = `index_base` + position in `x`)
    with the `half` ("hi": exp_avg's, "lo": exp_avg_sq's) of its random word: bit for bit the native
    kernel's stochastic rounding."""
    idx = torch.arange(x.numel(), dtype=torch.int64, device=x.device) + (index_base & _M32)
    if half not in ("hi", "lo"):
        raise ValueError(f"half must be 'hi' (exp_avg) or 'lo' (exp_avg_sq), got {half!r}")
    word = _hash32((idx + key) & _M32)
    r = word >> 16 if half == "hi" else word & 0xFFFF
    u = x.reshape(-1).view(torch.int32).to(torch.int64) & _M32
    out = ((u + r) >> 16) & 0xFFFF
    out = torch.where(torch.isnan(x.reshape(-1)), torch.full_like(out, 0xFFFF), out)
    out = torch.where(out >= 0x8000, out - 0x10000, out)  # the bit pattern as a signed 16-bit value
    return out.to(torch.int16).view(torch.bfloat16).view(x.shape)


def has_nonfinite(x: torch.Tensor, scale: float = 1.0) -> bool:
    y = x.float()
    if scale != 1.0:
        y = y * scale
    return not bool(torch.isfinite(y).all())


@torch.no_grad()
def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, adamw: bool, grad_scale: float = 1.0,
              check_overflow: bool = False, out: torch.Tensor | None = None, seed: int = 0,
              index_base: int = 0, fold: bool | None = None) -> bool:
    """Same contract as capstan_adam_step: returns True (and changes nothing) on overflow. bf16
    moments are updated in fp32 copies and stored back with the kernel's stochastic rounding. `fold`:
    the parameter's update with sqrt(1 - beta2^step) folded into the step size and eps (one division),
    as the kernel updates bf16 and 8-bit moments; default, where the moments are bf16. A bf16 `param`
    is stepped in an fp32 copy and stored back with the kernel's stochastic rounding (sr_key_param)."""
    f32 = torch.float32
    scale = torch.tensor(grad_scale, dtype=f32)  # the kernel multiplies by float(grad_scale)
    if check_overflow and has_nonfinite(grad, float(scale)):
        return True
    n = param.numel()
    if n > WINDOW and param.dim() == 1:
        for a in range(0, n, WINDOW):
            w = slice(a, min(n, a + WINDOW))
            adam_step(param[w], grad[w], exp_avg[w], exp_avg_sq[w], step=step, lr=lr, beta1=beta1, beta2=beta2,
                      eps=eps, weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale,
                      out=None if out is None else out[w], seed=seed, index_base=index_base + a, fold=fold)
        return False
    if param.dtype == torch.bfloat16:
        p32 = param.to(f32)
        adam_step(p32, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, seed=seed, index_base=index_base,
                  fold=fold)
        param.copy_(to_bf16_sr(p32, sr_key_param(seed), index_base, "hi"))
        return False
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
    m, v = exp_avg, exp_avg_sq
    if exp_avg.dtype != f32:
        m, v = exp_avg.to(f32), exp_avg_sq.to(f32)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc2 = (1.0 - beta2**step) ** 0.5
    if exp_avg.dtype != f32 if fold is None else fold:  # the kernel's one division (AdamArgs::neg_step_r, eps_r)
        neg_step_r = float(torch.tensor(-(lr / (1.0 - beta1**step)) * bc2, dtype=f32))
        param.addcdiv_(m, v.sqrt().add_(float(torch.tensor(eps * bc2, dtype=f32))), value=neg_step_r)
    else:
        param.addcdiv_(m, (v.sqrt() / bc2).add_(eps), value=-(lr / (1.0 - beta1**step)))
    if exp_avg.dtype != f32:
        key = sr_key(seed)
        exp_avg.copy_(to_bf16_sr(m, key, index_base, "hi"))
        exp_avg_sq.copy_(to_bf16_sr(v, key, index_base, "lo"))
    if out is not None:
        out.copy_(param)
    return False


@torch.no_grad()
def adam_step_q8(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 scale_m: torch.Tensor, scale_v: torch.Tensor, *, block: int,
                 segments: list[tuple[int, int, int]], step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, adamw: bool, grad_scale: float = 1.0,
                 check_overflow: bool = False, out: torch.Tensor | None = None, seed: int = 0) -> bool:
    """Same contract as capstan_adam_step_q8, in torch ops on any device, a window of whole blocks at a
    time (`_q8_window`)."""
    if check_overflow and any(has_nonfinite(grad[o:o + n], grad_scale) for o, n, _ in segments):
        return True
    key = sr_key(seed)
    first = 0
    window = max(block, WINDOW // block * block)  # whole blocks: each window's scales are its own
    for seg_off, seg_n, seg_index in segments:
        for a in range(0, seg_n, window):  # a parameter larger than a window: one window at a time
            off, n, index = seg_off + a, min(window, seg_n - a), seg_index + a
            _q8_window(param, grad, exp_avg, exp_avg_sq, scale_m, scale_v, block, off, n, index, first + a // block,
                       key, seed, step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale, out)
        first += -(-seg_n // block)
    return False


def _q8_window(param, grad, exp_avg, exp_avg_sq, scale_m, scale_v, block, off, n, index, first, key, seed, step, lr,
               beta1, beta2, eps, weight_decay, adamw, grad_scale, out) -> None:
    """`adam_step_q8` on the n elements at `off` (canonical index `index`), whose blocks' scales start at
    `first`: decoded, stepped as `adam_step` steps fp32 moments, then re-encoded against new scales."""
    nb = -(-n // block)
    sl, sc = slice(off, off + n), slice(first, first + nb)
    m = q8_decode(exp_avg[sl], Q8_EXP_AVG).view(-1) * per_element(scale_m[sc], block, n)
    r = q8_decode(exp_avg_sq[sl], Q8_EXP_AVG_SQ) * per_element(scale_v[sc], block, n)
    v = r * r
    p = param[sl] if param.dtype == torch.float32 else param[sl].to(torch.float32)
    adam_step(p, grad[sl], m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
              weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, fold=True)
    if param.dtype == torch.bfloat16:  # a bf16 master: rounded with the canonical index's word
        param[sl] = to_bf16_sr(p, sr_key_param(seed), index, "hi")
    r = v.sqrt()
    pad = nb * block - n
    new_m = q8_scale(torch.nn.functional.pad(m.abs(), (0, pad)).view(nb, block).amax(1))
    new_r = q8_scale(torch.nn.functional.pad(r, (0, pad)).view(nb, block).amax(1))
    scale_m[sc] = new_m
    scale_v[sc] = new_r
    rnd = _hash32((torch.arange(n, dtype=torch.int64, device=param.device) + index + key) & _M32)
    exp_avg[sl] = q8_encode(m * per_element(q8_inverse(new_m), block, n), Q8_EXP_AVG, rnd >> 16)
    exp_avg_sq[sl] = q8_encode(r * per_element(q8_inverse(new_r), block, n), Q8_EXP_AVG_SQ, rnd & 0xFFFF)
    if out is not None:
        out[sl] = p


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
