"""Adam's moments in 8 bits: the codes of capstan_adam_step_q8 (csrc/internal.h, Q8Format) in torch.

A moment is stored per block of `block` values of one parameter (blocks start at the parameter's first
element) as uint8 codes and one fp32 scale per block: exp_avg as a sign and an E4M3 small float of
|m| / absmax, exp_avg_sq as an unsigned E4M4 small float of sqrt(v) / max sqrt(v). The kernel rounds
stochastically; `quantize` rounds to nearest, and turns `dequantize`'s values back into the very codes
and scales they came from (each block's max codes exactly 1.0, q8_inverse), which is how checkpoints,
holding the moments' exact values in fp32, resume bit for bit.

    codes, scales = quantize(values, "exp_avg", block=256)
    assert torch.equal(dequantize(codes, scales, "exp_avg", 256), values)   # for values that came from codes
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "Q8_EXP_AVG", "Q8_EXP_AVG_SQ", "FORMATS", "q8_decode", "q8_encode", "q8_scale", "q8_inverse",
           "per_element", "dequantize", "quantize"]

_M32 = 0xFFFFFFFF
BLOCK = 256  # values per scale where capstan stores moments in 8 bits (bitsandbytes' and torchao's block)
# (exponent bits, mantissa bits, signed) of exp_avg's codes and of sqrt(exp_avg_sq)'s.
Q8_EXP_AVG = (4, 3, True)
Q8_EXP_AVG_SQ = (4, 4, False)
FORMATS = {"exp_avg": Q8_EXP_AVG, "exp_avg_sq": Q8_EXP_AVG_SQ}
_NEAREST = 1 << 15  # 16 "random" bits of one half: stochastic rounding becomes round half up


def q8_decode(codes: torch.Tensor, fmt: tuple[int, int, bool]) -> torch.Tensor:
    """fp32 values in [-1, 1] of uint8 `codes` in format `fmt` (exact)."""
    e_bits, m_bits, signed = fmt
    c = codes.to(torch.int64)
    mag = c & 0x7F if signed else c
    emin = (1 << e_bits) - 2
    bias = 127 - ((1 << e_bits) - 1)
    normal = ((mag << (23 - m_bits)) + (bias << 23)).to(torch.int32).view(torch.float32)
    out = torch.where((mag >> m_bits) == 0, mag.to(torch.float32) * 2.0 ** -(emin + m_bits), normal)
    if signed:
        out = torch.where((c & 0x80) != 0, -out, out)
    return out


def q8_encode(y: torch.Tensor, fmt: tuple[int, int, bool], r16: torch.Tensor | int) -> torch.Tensor:
    """uint8 codes of fp32 `y` (|y| <= 1) in format `fmt`, rounded stochastically with the 16 random bits
    of each element in `r16` (int64, or one int for all): capstan::q8_encode_mag."""
    e_bits, m_bits, signed = fmt
    emin = (1 << e_bits) - 2
    raw = y.view(torch.int32).to(torch.int64) & _M32
    a = y.abs()
    small = a < 2.0 ** -emin
    z = torch.where(small, a + 2.0 ** -emin, a)  # subnormals rounded on the smallest binade's grid
    u = z.view(torch.int32).to(torch.int64)
    c = ((u + (r16 << (7 - m_bits))) >> (23 - m_bits)) - ((127 - ((1 << e_bits) - 1)) << m_bits)
    c = (c - small.to(torch.int64) * (1 << m_bits)).clamp(max=((1 << e_bits) - 1) << m_bits)
    if signed:
        c = c | ((raw >> 24) & 0x80)
    return c.to(torch.uint8)


def q8_scale(max_abs: torch.Tensor) -> torch.Tensor:
    """capstan::q8_scale: a block whose max is below FLT_MIN is stored as zeros (NaN stays NaN)."""
    return torch.where(max_abs < 2.0**-126, torch.zeros_like(max_abs), max_abs)


def q8_inverse(scale: torch.Tensor) -> torch.Tensor:
    """capstan::q8_inverse: 1 / scale, one ulp up where scale * (1 / scale) < 1, so each block's max
    encodes as exactly 1.0; 1 for a zero or NaN scale."""
    ok = scale > 0
    inv = 1.0 / torch.where(ok, scale, torch.ones_like(scale))
    up = (inv.view(torch.int32) + 1).view(torch.float32)
    return torch.where(ok & (inv * scale < 1.0), up, inv)


def per_element(scales: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Each of n elements' block scale."""
    return scales.repeat_interleave(block)[:n]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, field: str, block: int) -> torch.Tensor:
    """The fp32 values of one parameter's moment `field` ("exp_avg", or "exp_avg_sq": then the square of
    the decoded root) from its codes (flat) and its ceil(n / block) scales."""
    n = codes.numel()
    x = q8_decode(codes.reshape(-1), FORMATS[field]) * per_element(scales, block, n)
    return x * x if field == "exp_avg_sq" else x


def quantize(values: torch.Tensor, field: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of one parameter's fp32 moment `field` (flat), rounded to nearest; the inverse of
    `dequantize` on its own output (sqrt(v * v) == v for fp32 v >= 1e-19)."""
    x = values.reshape(-1).to(torch.float32)
    if field == "exp_avg_sq":
        x = x.clamp_min(0).sqrt()
    n = x.numel()
    nb = -(-n // block)
    pad = nb * block - n
    scales = q8_scale(torch.nn.functional.pad(x.abs(), (0, pad)).view(nb, block).amax(1)) if n else x.new_zeros(0)
    codes = q8_encode(x * per_element(q8_inverse(scales), block, n), FORMATS[field], _NEAREST)
    return codes, scales
