"""Adam on a bf16 master (no fp32 copy): the parameter updated in fp32 and stored with stochastic rounding
from a hash stream of its own, the same bits on every ISA, thread count, slicing and the torch fallback,
with fp32, bf16 or 8-bit moments; unbiased, so updates below half a bf16 ulp still move it."""

from __future__ import annotations

import pytest
import torch

from capstan.native import _lib, fallback, kernels

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
BF16 = torch.bfloat16


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    return t.view(torch.int16) if t.dtype == BF16 else t.view(torch.int32)


def state(gen: torch.Generator, n: int, moments: torch.dtype) -> list[torch.Tensor]:
    p = torch.randn(n, generator=gen).to(BF16)
    m = (torch.randn(n, generator=gen) * 0.1).to(moments)
    v = (torch.rand(n, generator=gen) * 0.01).to(moments)
    return [p, m, v]


def steps(fn, s: list[torch.Tensor], g: torch.Tensor, n_steps: int = 4, **kw) -> list[torch.Tensor]:  # noqa: ANN001
    s = [t.clone() for t in s]
    for step in range(1, n_steps + 1):
        fn(s[0], g, s[1], s[2], step=step, seed=0xABCD_0000_0000 + step, **kw)
    return s


@pytest.mark.parametrize("moments", [torch.float32, BF16])
@pytest.mark.parametrize("grad_dtype,adamw", [(torch.float32, True), (BF16, True), (BF16, False)])
@pytest.mark.parametrize("n", [1, 23, 4099, 100_003])
def test_every_isa_equals_the_fallback_bit_for_bit(isa, gen, moments, grad_dtype, adamw, n):
    """Four steps, weight decay on, a gradient scale: parameter and moments equal the torch fallback's
    (fallback.adam_step, the GPU's form) in every bit, on each compiled instruction set."""
    s, g = state(gen, n, moments), (torch.randn(n, generator=gen) * 256).to(grad_dtype)
    kw = dict(weight_decay=0.01, adamw=adamw, grad_scale=1 / 256, index_base=12345, **HP)
    nat = steps(kernels.adam_update, s, g, **kw)
    ref = steps(fallback.adam_step, s, g, **kw)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), nat, ref, strict=True):
        assert torch.equal(bits(a), bits(b)), f"{name} differs from the fallback on {isa}"
    assert not torch.equal(nat[0], s[0])


@pytest.mark.parametrize("cuts", [(0, 1000, 4099), (0, 7, 64, 65, 4099)])
def test_slices_with_their_offsets_equal_one_whole_call(isa, gen, cuts):
    """Chunks and ZeRO shards step a buffer in slices: with each slice's offset as index_base the bf16
    parameter rounds as it does in one call over the whole buffer."""
    n = cuts[-1]
    s, g = state(gen, n, BF16), torch.randn(n, generator=gen)
    whole = [t.clone() for t in s]
    kernels.adam_update(whole[0], g, whole[1], whole[2], step=3, seed=5, **HP)
    parts = [t.clone() for t in s]
    for lo, hi in zip(cuts, cuts[1:]):
        kernels.adam_update(*(t[lo:hi] for t in (parts[0], g, parts[1], parts[2])), step=3, seed=5, index_base=lo,
                            **HP)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(whole, parts, strict=True))


def test_thread_count_does_not_change_a_bit(gen):
    if _lib.get() is None:
        pytest.skip(f"requires_native: libcapstan not loaded ({_lib.load_error()})")
    n = 1_000_003
    s, g = state(gen, n, torch.float32), torch.randn(n, generator=gen)
    before, out = kernels.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            kernels.set_num_threads(threads)
            out.append(steps(kernels.adam_update, s, g, n_steps=2, **HP))
    finally:
        kernels.set_num_threads(before)
    assert all(torch.equal(bits(a), bits(b)) for other in out[1:] for a, b in zip(out[0], other, strict=True))


SEGMENTS = [(0, 1037, 0), (1040, 300, 5000), (1340, 4000, 1037)]  # a gap, canonical indices out of order
N = 5340


@pytest.mark.parametrize("grad_dtype,adamw,weight_decay", [(torch.float32, True, 0.01), (BF16, False, 0.01),
                                                           (BF16, True, 0.0)])
def test_8bit_moments_step_a_bf16_master_as_an_fp32_one_then_round_it(isa, gen, grad_dtype, adamw, weight_decay):
    _master_as_fp32_then_rounded(kernels.adam_update_q8, gen, grad_dtype, adamw, weight_decay, isa)


def test_the_8bit_fallback_steps_a_bf16_master_alike(gen):
    """The torch form (the accelerator's path) holds the same relation to its own fp32 step."""
    def step(*args, **kw) -> None:  # noqa: ANN002, ANN003
        fallback.adam_step_q8(*args, block=256, grad_scale=1.0, **kw)
    _master_as_fp32_then_rounded(step, gen, BF16, True, 0.01, "the fallback")


def _master_as_fp32_then_rounded(update, gen, grad_dtype, adamw, weight_decay, where) -> None:  # noqa: ANN001
    """The 8-bit kernel with a bf16 master, five steps: each step's codes and scales are those of the same
    step on an fp32 parameter holding the master's values (test_adam_q8 checks that one against its
    reference bit for bit), and the master is that step's fp32 result rounded stochastically with the
    parameter's stream at each element's canonical index (a segment's `index`), as the codes draw theirs;
    elements between segments are not touched."""
    p = torch.randn(N, generator=gen).to(BF16)
    blocks = kernels.q8_blocks([n for _, n, _ in SEGMENTS], 256)
    nat = [p.clone(), torch.zeros(N, dtype=torch.uint8), torch.zeros(N, dtype=torch.uint8), torch.zeros(blocks),
           torch.zeros(blocks)]
    f32 = [t.clone() for t in nat]
    for step in range(1, 6):
        g = (torch.randn(N, generator=gen) * torch.logspace(-4, 0, N)).to(grad_dtype)
        kw = dict(step=step, segments=SEGMENTS, seed=77 + step, weight_decay=weight_decay, adamw=adamw, **HP)
        f32[0] = nat[0].float()
        update(nat[0], g, *nat[1:], **kw)
        update(f32[0], g, *f32[1:], **kw)
        for name, a, b in zip(("exp_avg", "exp_avg_sq", "scale_m", "scale_v"), nat[1:], f32[1:], strict=True):
            assert torch.equal(bits(a), bits(b)), f"{name} differs from the fp32 master's at step {step} on {where}"
        key = fallback.sr_key_param(77 + step)
        for off, n, index in SEGMENTS:
            want = fallback.to_bf16_sr(f32[0][off:off + n], key, index, "hi")
            assert torch.equal(bits(nat[0][off:off + n]), bits(want)), f"param at step {step} on {where}"
    assert torch.equal(nat[0][1037:1040], p[1037:1040]) and not torch.equal(nat[0][:1037], p[:1037])
    assert nat[1].any() and nat[2].any()


def test_updates_below_half_an_ulp_move_the_master_in_expectation():
    """Every update here is about a fortieth of a bf16 ulp at 1.0: nearest rounding (a bf16 master without
    stochastic rounding) would never move the parameter; stochastically rounded, its mean follows the fp32
    trajectory within a few percent."""
    n, k, lr = 200_000, 40, 1e-4
    p, m, v = torch.ones(n, dtype=BF16), torch.zeros(n), torch.zeros(n)
    p32, m32, v32 = torch.ones(n), torch.zeros(n), torch.zeros(n)
    g = torch.full((n,), 0.5)
    for step in range(1, k + 1):
        kernels.adam_update(p, g, m, v, step=step, seed=step, **dict(HP, lr=lr))
        kernels.adam_update(p32, g, m32, v32, step=step, **dict(HP, lr=lr))
    drift, expected = 1.0 - float(p.double().mean()), 1.0 - float(p32[0])
    assert expected == pytest.approx(k * lr, rel=1e-3)
    assert drift == pytest.approx(expected, rel=0.05), (drift, expected)


def test_the_parameter_draws_other_bits_than_the_moments():
    """Its stream is a hash of the moments' key, never the moments' own words."""
    for seed in (0, 1, 2**40 + 3):
        assert fallback.sr_key_param(seed) != fallback.sr_key(seed)
