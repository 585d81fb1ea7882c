"""Adam with bf16 moments: stochastic rounding that is the same bits on every ISA, thread count and the
torch fallback, unbiased, and keeps the second moment's decay that nearest rounding loses."""

from __future__ import annotations

import pytest
import torch

from capstan.native import fallback, kernels

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bf16_state(gen: torch.Generator, n: int) -> list[torch.Tensor]:
    return [torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 0.1).bfloat16(),
            torch.rand(n, generator=gen).bfloat16()]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", [1, 23, 4099, 100_003])
def test_every_isa_equals_scalar_bit_for_bit(isa, gen, grad_dtype, n):
    state = bf16_state(gen, n)
    g = (torch.randn(n, generator=gen) * 512).to(grad_dtype)
    out = []
    for which in ("scalar", isa):
        kernels.set_isa(which)
        s, h = [t.clone() for t in state], torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2, 3):
            kernels.adam_update_and_cast(s[0], g, s[1], s[2], h, step=step, weight_decay=0.01, grad_scale=1 / 512,
                                         seed=0x1234_5678_9ABC + step, **HP)
        out.append(s + [h])
    for x, y in zip(*out):
        assert torch.equal(bits(x), bits(y))


@pytest.mark.parametrize("n", [1, 23, 4099, 100_003])
def test_the_rounding_is_the_fallbacks_bit_for_bit(isa, gen, n):
    """With beta1 = beta2 = 0 the fp32 moments are exactly g and g*g in both (no ATen rounding difference
    can enter), so the stored bf16 moments isolate the stochastic rounding: every bit equal, for seeds
    whose two 32-bit halves both matter."""
    g = torch.randn(n, generator=gen) * 3
    hp = dict(HP, beta1=0.0, beta2=0.0)
    for seed in (0, 1, 2**32, 2**64 - 1, 0x9E3779B97F4A7C15):
        a, b = bf16_state(gen, n), None
        b = [t.clone() for t in a]
        kernels.adam_update(a[0], g, a[1], a[2], step=1, seed=seed, **hp)
        fallback.adam_step(b[0], g, b[1], b[2], step=1, weight_decay=0.0, adamw=True, seed=seed, **hp)
        assert torch.equal(bits(a[1]), bits(b[1])) and torch.equal(bits(a[2]), bits(b[2]))
        assert float(((a[0] - b[0]).abs() / b[0].abs().clamp_min(1e-2)).max()) <= 1e-6


def test_thread_count_does_not_change_a_bit(gen):
    n = 1_000_003
    state, g = bf16_state(gen, n), torch.randn(n, generator=gen)
    before = kernels.get_num_threads()
    out = []
    try:
        for threads in (1, 2, 3):
            kernels.set_num_threads(threads)
            s = [t.clone() for t in state]
            kernels.adam_update(s[0], g, s[1], s[2], step=7, seed=99, **HP)
            out.append(s)
    finally:
        kernels.set_num_threads(before)
    for other in out[1:]:
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(out[0], other))


def test_the_update_uses_the_unrounded_moments(gen):
    """The parameter moves by the fp32 moments an fp32-moment step computes from the same (bf16-valued)
    moments, through the one-division form p + (-step_size * bc2) * m / (sqrt(v) + eps * bc2), bc2 =
    sqrt(1 - beta2^t) (each constant rounded to fp32 once): only the stored moments are rounded."""
    n, step = 4099, 3
    p, m, v = bf16_state(gen, n)
    g = torch.randn(n, generator=gen)
    p0, p32, m32, v32 = p.clone(), p.clone(), m.float(), v.float()
    kernels.adam_update(p, g, m, v, step=step, seed=5, **HP)
    kernels.adam_update(p32, g, m32, v32, step=step, **HP)  # m32, v32: the moments before rounding
    bc2 = (1.0 - HP["beta2"] ** step) ** 0.5
    neg_step_r = torch.tensor(-(HP["lr"] / (1.0 - HP["beta1"] ** step)) * bc2, dtype=torch.float32)
    eps_r = torch.tensor(HP["eps"] * bc2, dtype=torch.float32)
    root = v32.double().sqrt().float()  # correctly rounded, as the instruction (torch's may be an ulp off)
    assert torch.equal(p, p0 + (neg_step_r * m32) / (root + eps_r))
    # torch.optim's two divisions (the fp32-moment step) differ in the last bits of the update only
    assert float(((p - p32).abs() / p32.abs().clamp_min(1e-2)).max()) <= 1e-6
    # each stored moment is one of the two bf16 values around the fp32 one: its top half truncated, or the next
    for low_prec, full in ((m, m32), (v, v32)):
        truncated = (full.view(torch.int32).to(torch.int64) >> 16) & 0xFFFF
        stored = low_prec.view(torch.int16).to(torch.int64) & 0xFFFF
        assert bool(((stored == truncated) | (stored == truncated + 1)).all())
        assert bool((stored == truncated + 1).any()) and bool((stored == truncated).any())


def test_stochastic_rounding_is_unbiased():
    """Rounding the same value with many seeds averages to the value; nearest rounding does not."""
    x = torch.full((4096,), 1.0 + 2**-10)  # an eighth of the way from 1.0 to the next bf16, 1 + 2**-7
    key_means = []
    for seed in range(64):
        key = fallback.sr_key(seed)
        key_means.append(float(fallback.to_bf16_sr(x, key).float().mean()))
    mean = sum(key_means) / len(key_means)
    assert abs(mean - float(x[0])) < 2e-5, mean
    assert float(x.bfloat16().float()[0]) == 1.0  # nearest rounding loses it


def test_second_moment_decays_with_zero_gradients():
    """v * beta2 rounds back to v in bf16 with nearest rounding; stochastic rounding keeps the decay."""
    n = 20_000
    p, m, v = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    g = torch.zeros(n)
    steps = 200
    for step in range(1, steps + 1):
        kernels.adam_update(p, g, m, v, step=step, seed=step, **HP)
    want = HP["beta2"] ** steps
    assert abs(float(v.float().mean()) - want) / want < 0.01
    assert torch.equal(torch.ones(n).bfloat16() * HP["beta2"], torch.ones(n).bfloat16())  # nearest: stuck at 1


def test_moments_must_share_a_dtype_and_seed_must_fit():
    p, g = torch.zeros(8), torch.zeros(8)
    with pytest.raises(TypeError, match="exp_avg_sq has dtype float32"):
        kernels.adam_update(p, g, torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), step=1)
    with pytest.raises(TypeError, match="exp_avg has dtype float16"):
        kernels.adam_update(p, g, torch.zeros(8, dtype=torch.float16), torch.zeros(8, dtype=torch.float16), step=1)
    with pytest.raises(ValueError, match="seed must be an int"):
        kernels.adam_update(p, g, torch.zeros(8), torch.zeros(8), step=1, seed=-1)


def test_nan_and_inf_moments_keep_their_meaning():
    p, g = torch.zeros(4), torch.tensor([float("nan"), float("inf"), 1.0, -1.0])
    m, v = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    kernels.adam_update(p, g, m, v, step=1, seed=3, **HP)
    assert torch.isnan(m[0]) and torch.isnan(v[0]) and torch.isinf(v[1])
    assert bits(m)[0] == -1  # 0xFFFF, as the nearest-rounding casts write NaN


@pytest.mark.parametrize("cuts", [(0, 1000, 4099), (0, 7, 64, 65, 4099)])
def test_slices_with_their_offsets_equal_one_whole_call(isa, gen, cuts):
    """ZeRO shards and chunks step a buffer in slices; passing each slice's offset as index_base gives the
    bits of one call over the whole buffer, so a layout's slicing does not change the trajectory."""
    n = cuts[-1]
    state, g = bf16_state(gen, n), torch.randn(n, generator=gen)
    whole = [t.clone() for t in state]
    kernels.adam_update(whole[0], g, whole[1], whole[2], step=2, seed=77, **HP)
    parts = [t.clone() for t in state]
    for lo, hi in zip(cuts, cuts[1:]):
        kernels.adam_update(parts[0][lo:hi], g[lo:hi], parts[1][lo:hi], parts[2][lo:hi], step=2, seed=77,
                            index_base=lo, **HP)
    for x, y in zip(whole, parts):
        assert torch.equal(bits(x), bits(y))
    fb = [t.clone() for t in state]
    lo, hi = cuts[1], cuts[2]
    fallback.adam_step(fb[0][lo:hi], g[lo:hi], fb[1][lo:hi], fb[2][lo:hi], step=2, weight_decay=0.0, adamw=True,
                       seed=77, index_base=lo, **dict(HP, beta1=0.0, beta2=0.0))
    nat = [t.clone() for t in state]
    kernels.adam_update(nat[0][lo:hi], g[lo:hi], nat[1][lo:hi], nat[2][lo:hi], step=2, seed=77, index_base=lo,
                        **dict(HP, beta1=0.0, beta2=0.0))
    assert torch.equal(bits(fb[1]), bits(nat[1])) and torch.equal(bits(fb[2]), bits(nat[2]))


def test_a_rounding_half_other_than_hi_or_lo_is_refused():
    with pytest.raises(ValueError, match="half must be 'hi' .exp_avg. or 'lo' .exp_avg_sq., got 'high'"):
        fallback.to_bf16_sr(torch.ones(2), 0, half="high")
