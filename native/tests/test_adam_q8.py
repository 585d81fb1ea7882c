"""Adam with 8-bit moments (kernels.adam_update_q8): bit for bit a reference written here in plain torch.

The reference below does not share code with the kernel or with fallback.py: it decodes through a table
of the 256 code values (written from the format's definition), finds each value's neighbours by search,
and rounds up where the random bits carry across the gap, as the kernel's integer trick does. The Adam
arithmetic follows the kernel's operations (explicit fused multiply-adds, emulated exactly in float64:
the product of two floats is exact there, and one rounding of the sum to fp32 agrees with the fused
instruction except in double-rounding ties, which these fixed inputs do not hit), and square roots
correctly rounded through float64 (torch's vectorized fp32 sqrt is not always: it differed from the
instruction by an ulp here).
"""

from __future__ import annotations

import pytest
import torch

from capstan.native import _lib, fallback, kernels, q8

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
F32 = torch.float32
M32 = 0xFFFFFFFF
# (exponent bits, mantissa bits, signed) of exp_avg's codes and of sqrt(exp_avg_sq)'s
FMT_M, FMT_V = (4, 3, True), (4, 4, False)
# Parameters of a chunk: sizes not multiples of a block or of a vector, one empty, gaps between them.
SEGMENTS = [(0, 1000, 0), (1000, 37, 1000), (1040, 0, 1037), (1100, 3900, 1037), (5000, 17, 4937)]
N = 5040


def values(fmt) -> torch.Tensor:
    """The 2^(E+M) non-negative code values, in code order (float64): subnormals k * 2^-(emin + M), then
    (1 + f / 2^M) * 2^(e - (2^E - 1)) for exponent field e >= 1."""
    e_bits, m_bits, _ = fmt
    emin, top = (1 << e_bits) - 2, (1 << e_bits) - 1
    out = []
    for code in range(1 << (e_bits + m_bits)):
        e, f = code >> m_bits, code & ((1 << m_bits) - 1)
        out.append(f * 2.0 ** -(emin + m_bits) if e == 0 else (1 + f / 2**m_bits) * 2.0 ** (e - top))
    return torch.tensor(out, dtype=torch.float64)


def decode(codes: torch.Tensor, fmt) -> torch.Tensor:
    table = values(fmt)
    c = codes.to(torch.int64)
    mag = table[c & 0x7F if fmt[2] else c]
    return torch.where((c >= 0x80) if fmt[2] else torch.zeros_like(c, dtype=torch.bool), -mag, mag).to(F32)


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def encode(y: torch.Tensor, fmt, r16: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of |y| <= 1 to the code grid: the value below and the gap above it, and up
    when the first 16 bits of y's fraction of the gap plus 16 random bits reach 2^16. A subnormal y is
    first added to 2^-emin in fp32 (the kernel rounds it on the smallest normal binade's grid, whose
    spacing is the subnormals'), which may round away its last bits; that sum less 2^-emin is exact."""
    e_bits, m_bits, signed = fmt
    table = values(fmt)
    emin = (1 << e_bits) - 2
    a = y.abs()
    tiny = a < 2.0 ** -emin
    a = torch.where(tiny, (a + f32(2.0 ** -emin)).double() - 2.0 ** -emin, a.double())
    top = ((1 << e_bits) - 1) << m_bits  # the code of 1.0
    lo = (torch.searchsorted(table[:top + 1], a, right=True) - 1).clamp(0, top)
    gap = table[(lo + 1).clamp(max=top)] - table[lo]
    frac = torch.floor((a - table[lo]) / torch.where(gap > 0, gap, 1.0) * 2.0**16).to(torch.int64)
    code = lo + ((frac + r16 >= 1 << 16) & (lo < top)).to(torch.int64)
    if signed:
        code = code | torch.where(y.view(torch.int32) < 0, 0x80, 0)
    return code.to(torch.uint8)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double() + c.double()).to(F32)


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F32)


def scale_of(max_abs: torch.Tensor) -> torch.Tensor:
    return f32(0.0) if float(max_abs) < 2.0**-126 else max_abs


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, or the next float above it where scale times it falls short of 1 (the max must code 1.0)."""
    if not float(scale) > 0:
        return f32(1.0)
    inv = f32(1.0) / scale
    return torch.nextafter(inv, f32(float("inf"))) if float(inv * scale) < 1.0 else inv


def reference_step(p, g, cm, cv, sm, sv, *, step, block, segments, seed, lr, beta1, beta2, eps,
                   weight_decay, adamw, grad_scale=1.0):
    """The whole call on copies; returns (p, codes m, codes v, scales m, scales v)."""
    p, cm, cv, sm, sv = p.clone(), cm.clone(), cv.clone(), sm.clone(), sv.clone()
    key = fallback.sr_key(seed)
    w1 = f32(1.0 - beta1)
    # torch.optim's p + (-step_size * m) / (sqrt(v) / bc2 + eps) with bc2 = sqrt(1 - beta2^step) moved
    # out of the denominator: p + (-step_size * bc2) * m / (sqrt(v) + eps * bc2), each constant
    # rounded to fp32 once from double (one division a value; capstan::AdamArgs::neg_step_r).
    bc2 = (1.0 - beta2**step) ** 0.5
    neg_step_r = f32(-(lr / (1.0 - beta1**step)) * bc2)
    eps_r = f32(eps * bc2)
    k = 0
    for off, n, index in segments:
        for b0 in range(0, n, block):
            lo, hi = off + b0, off + min(n, b0 + block)
            x = p[lo:hi]
            gr = g[lo:hi].to(F32)
            if grad_scale != 1.0:
                gr = gr * f32(grad_scale)
            m = decode(cm[lo:hi], FMT_M) * sm[k]
            root = decode(cv[lo:hi], FMT_V) * sv[k]
            v = root * root
            if weight_decay:
                if adamw:
                    x = x * f32(1.0 - lr * weight_decay)
                else:
                    gr = fma(f32(weight_decay).expand_as(x), x, gr)
            if float(w1) >= 0.5:
                m = fma((w1 - 1.0).expand_as(m), gr - m, gr)
            else:
                m = fma(w1.expand_as(m), gr - m, m)
            v = fma(f32(1.0 - beta2) * gr, gr, v * f32(beta2))
            root = v.double().sqrt().to(F32)  # correctly rounded, as sqrtps is (torch's may be off by an ulp)
            x = x + (neg_step_r * m) / (root + eps_r)
            p[lo:hi] = x
            am, ar = scale_of(m.abs().max()), scale_of(root.max())
            sm[k], sv[k] = am, ar
            r = lowbias32((torch.arange(hi - lo, dtype=torch.int64) + index + b0 + key) & M32)
            cm[lo:hi] = encode(m * inverse(am), FMT_M, r >> 16)
            cv[lo:hi] = encode(root * inverse(ar), FMT_V, r & 0xFFFF)
            k += 1
    return p, cm, cv, sm, sv


def fresh(gen, segments=SEGMENTS, n=N, block=256):
    nb = kernels.q8_blocks([s[1] for s in segments], block)
    return [torch.randn(n, generator=gen), torch.zeros(n, dtype=torch.uint8),
            torch.zeros(n, dtype=torch.uint8), torch.zeros(nb), torch.zeros(nb)]


def gradient(gen, n=N, dtype=F32) -> torch.Tensor:
    # magnitudes over six decades, so blocks hold both ends of the code range and its subnormals
    return (torch.randn(n, generator=gen) * torch.logspace(-6, 0, n)[torch.randperm(n, generator=gen)]).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == F32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


@pytest.mark.parametrize("block,grad_dtype,adamw,weight_decay", [
    (16, torch.float32, True, 0.01), (256, torch.float32, True, 0.01), (256, torch.bfloat16, False, 0.01),
    (256, torch.float16, True, 0.0), (2048, torch.float32, False, 0.0)])
def test_bit_for_bit_the_reference_on_every_isa(isa, gen, block, grad_dtype, adamw, weight_decay):
    """Five steps on a buffer of parameters with gaps: parameters, codes and scales equal the plain-torch
    reference bit for bit (the `isa` fixture runs each compiled instruction set)."""
    state = fresh(gen, block=block)
    ref = [t.clone() for t in state]
    for step in range(1, 6):
        g = gradient(gen, dtype=grad_dtype)
        args = dict(step=step, block=block, segments=SEGMENTS, seed=1000 + step, weight_decay=weight_decay,
                    adamw=adamw, **HP)
        kernels.adam_update_q8(state[0], g, *state[1:], **args)
        ref = list(reference_step(ref[0], g, *ref[1:], **args))
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "scale_m", "scale_v"), state, ref):
            assert same(a, b), f"{name} differs from the reference at step {step}"
    assert state[1].any() and state[2].any() and bool((state[1] >= 0x80).any())  # signs, codes in use
    gap = slice(1037, 1040)
    assert not state[1][gap].any() and not state[2][gap].any()  # between segments: untouched


def test_grad_scale_and_fused_cast(isa, gen):
    state, ref = fresh(gen), None
    ref = [t.clone() for t in state]
    out = torch.empty(N, dtype=torch.bfloat16)
    g = (gradient(gen) * 1024).to(torch.float16)
    kernels.adam_update_q8(state[0], g, *state[1:], step=1, segments=SEGMENTS, grad_scale=1 / 1024, out=out,
                           **HP)
    ref = reference_step(ref[0], g, *ref[1:], step=1, block=256, segments=SEGMENTS, seed=0, weight_decay=0.0,
                         adamw=True, grad_scale=1 / 1024, **HP)
    assert all(same(a, b) for a, b in zip(state, ref))
    inside = torch.cat([torch.arange(o, o + n) for o, n, _ in SEGMENTS])
    assert torch.equal(out[inside].view(torch.int16), state[0][inside].to(torch.bfloat16).view(torch.int16))


def test_same_bits_for_any_thread_count(gen):
    if _lib.get() is None:  # the fallback has no thread count to vary
        pytest.skip(f"requires_native: libcapstan not loaded ({_lib.load_error()})")
    n = 1 << 20
    segs = [(0, n - 1000, 0), (n - 1000, 1000, n - 1000)]
    base = fresh(gen, segs, n)
    g = gradient(gen, n)
    results = []
    before = kernels.get_num_threads()
    try:
        for threads in (1, 2, 7):
            kernels.set_num_threads(threads)
            s = [t.clone() for t in base]
            for step in (1, 2):
                kernels.adam_update_q8(s[0], g, *s[1:], step=step, segments=segs, seed=step, **HP)
            results.append(s)
    finally:
        kernels.set_num_threads(before)
    for s in results[1:]:
        assert all(same(a, b) for a, b in zip(s, results[0]))


def test_fallback_follows_the_kernel(gen):
    """fallback.adam_step_q8 (torch ops: the accelerator's path) keeps ATen's roundings, not the
    kernel's fused ones, so it agrees to the last bits of the parameter and nearly every code."""
    a = fresh(gen)
    b = [t.clone() for t in a]
    for step in range(1, 4):
        g = gradient(gen)
        kernels.adam_update_q8(a[0], g, *a[1:], step=step, segments=SEGMENTS, seed=step, **HP)
        fallback.adam_step_q8(b[0], g, *b[1:], block=256, segments=SEGMENTS, step=step, seed=step,
                              weight_decay=0.0, adamw=True, **HP)
    assert float(((a[0] - b[0]).abs() / b[0].abs().clamp_min(1e-2)).max()) <= 1e-6
    for x, y in ((a[1], b[1]), (a[2], b[2])):
        assert float((x != y).float().mean()) < 0.01
    torch.testing.assert_close(a[3], b[3], rtol=1e-5, atol=0)
    torch.testing.assert_close(a[4], b[4], rtol=1e-5, atol=0)


def test_rounding_is_unbiased_and_keeps_small_values(gen):
    """Decoded codes average to the value they encode (stochastic rounding across many seeds), in the
    normal and the subnormal range, and a value 1e-6 of the block's max survives (no flush to zero)."""
    y = torch.tensor([0.3, -0.7, 1e-3, 3e-5, 1e-6, 0.0, 1.0], dtype=F32)
    draws = 4000
    r16 = lowbias32(torch.arange(draws * y.numel(), dtype=torch.int64) + 12345) >> 16
    codes = q8.q8_encode(y.repeat(draws), q8.Q8_EXP_AVG, r16)
    mean = q8.q8_decode(codes, q8.Q8_EXP_AVG).view(draws, -1).double().mean(0)
    # 4000 draws: the mean of 1e-6 (0.13 of the smallest code, 2^-17) has a standard deviation of 4e-8
    torch.testing.assert_close(mean, y.double(), rtol=0.03, atol=2e-7)
    assert bool((codes.view(draws, -1)[:, 4] != 0).any())
    assert torch.equal(decode(codes, FMT_M), q8.q8_decode(codes, FMT_M))


def test_overflow_changes_nothing(isa, gen):
    state = fresh(gen)
    kernels.adam_update_q8(state[0], gradient(gen), *state[1:], step=1, segments=SEGMENTS, **HP)
    before = [t.clone() for t in state]
    g = gradient(gen)
    g[1100 + 3000] = float("inf")
    assert kernels.adam_update_q8(state[0], g, *state[1:], step=2, segments=SEGMENTS, check_overflow=True, **HP)
    assert all(same(a, b) for a, b in zip(state, before))


def test_a_zero_gradient_keeps_zero_moments(gen):
    state = fresh(gen)
    p0 = state[0].clone()
    kernels.adam_update_q8(state[0], torch.zeros(N), *state[1:], step=1, segments=SEGMENTS, **HP)
    assert torch.equal(state[0], p0) and not state[1].any() and not state[2].any()
    assert not state[3].any() and not state[4].any()


@pytest.mark.parametrize("change,match", [
    (dict(block=100), "block must be a power of two"),
    (dict(block=8192), "block must be a power of two"),
    (dict(segments=[(0, 10, 0), (5, 10, 10)]), r"segments\[1\].*not overlap"),
    (dict(segments=[(0, N + 1, 0)]), r"segments\[0\].*within"),
    (dict(segments=[(0, 10)]), r"segments\[0\] must be three ints"),
    (dict(scale_m=torch.zeros(3)), "scale_m has 3 elements"),
    (dict(exp_avg=torch.zeros(N)), "exp_avg has dtype float32"),
    (dict(step=0), "step must be an int >= 1"),
])
def test_bad_arguments_are_named(gen, change, match):
    s = fresh(gen)
    args = dict(param=s[0], grad=torch.zeros(N), exp_avg=s[1], exp_avg_sq=s[2], scale_m=s[3], scale_v=s[4],
                step=1, segments=SEGMENTS)
    args.update(change)
    with pytest.raises((TypeError, ValueError), match=match):
        kernels.adam_update_q8(**args)


@pytest.mark.parametrize("block", [16, 256])
def test_dequantized_values_quantize_back_to_the_same_codes(gen, block):
    """Checkpoints hold the moments' exact fp32 values; `q8.quantize` (round to nearest) turns them back
    into the kernel's codes and scales bit for bit, also for a block whose max sits an ulp below its
    reciprocal's product and for tiny values in the codes' subnormal range."""
    state = fresh(gen, block=block)
    for step in range(1, 4):
        kernels.adam_update_q8(state[0], gradient(gen), *state[1:], step=step, block=block, segments=SEGMENTS,
                               seed=step, **HP)
    first = 0
    for off, n, _ in SEGMENTS:
        nb = -(-n // block)
        for field, codes, scales in (("exp_avg", state[1], state[3]), ("exp_avg_sq", state[2], state[4])):
            c, s = codes[off:off + n], scales[first:first + nb]
            values = q8.dequantize(c, s, field, block)
            c2, s2 = q8.quantize(values, field, block)
            assert torch.equal(c2, c) and same(s2, s), f"{field} of segment at {off}"
        first += nb
