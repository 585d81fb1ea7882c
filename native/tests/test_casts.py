"""Casts, copies and reductions: native vs torch (bit-identical) on every ISA path."""

from __future__ import annotations

import pytest
import torch

from capstan.native import fallback, kernels

SIZES = [1, 7, 22, 64, 1_000_003]
SPECIAL_BITS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                0xFFC00001, 0x7FFFFFFF, 0x00000001, 0x00400000, 0x807FFFFF, 0x3F808000,
                0x3F818000, 0x477FE000, 0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001,
                0x387FC000, 0x7F7FFFFF]


def random_f32_bits(n: int, gen: torch.Generator) -> torch.Tensor:
    """Every kind of fp32: random bit patterns (NaNs, infs, denormals) plus the tricky ones."""
    bits = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=gen)
    special = torch.tensor(SPECIAL_BITS, dtype=torch.int64).to(torch.int32)
    k = min(n, len(special))
    bits[:k] = special[:k]
    return bits.view(torch.float32)


def all_16bit(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ib = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ib), b.view(ib))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_f32_to_16_bit_identical_to_torch(isa, gen, n, dtype):
    x = random_f32_bits(n, gen)
    out = torch.empty(n, dtype=dtype)
    kernels.cast_(x, out)
    ref = x.to(dtype)
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        # torch's scalar bf16 path writes NaN as 0x7FC0, its SIMD path (what the
        # native kernels match) as 0xFFFF; only NaN-ness is comparable then.
        nan = torch.isnan(x)
        assert same_bits(out[~nan], ref[~nan]) and bool(torch.isnan(out[nan].float()).all())
    else:
        assert same_bits(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_to_f32_bit_identical_all_values(isa, dtype):
    h = all_16bit(dtype)
    out = torch.empty(h.numel(), dtype=torch.float32)
    kernels.cast_(h, out)
    assert same_bits(out, h.float())


def test_nan_stays_nan(isa):
    x = torch.tensor([float("nan"), -float("nan"), 1.0, float("inf")] * 9)
    for dtype in (torch.bfloat16, torch.float16):
        out = kernels.cast_(x, torch.empty(x.numel(), dtype=dtype))
        assert torch.isnan(out.float()).tolist() == torch.isnan(x).tolist()


@pytest.mark.parametrize("n", SIZES)
def test_bf16_f16_cross_cast(isa, gen, n):
    h = torch.randn(n, generator=gen).to(torch.bfloat16)
    out = kernels.cast_(h, torch.empty(n, dtype=torch.float16))
    assert same_bits(out, h.float().to(torch.float16))


# Destinations of 4 MiB and more take the non-temporal store path (api.cc
# kStreamBytes): a scalar head up to a 64-byte boundary, the streamed vector
# loop, then the plain tail. Offsets make dst and src start off the boundary.
STREAM_N = (4 << 20) // 2 + 4099  # > 4 MiB of 16-bit output


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_streamed_f32_to_16_bit_identical_to_torch(isa, gen, offset, dtype):
    x = random_f32_bits(STREAM_N + offset, gen)[offset:]
    out = torch.empty(STREAM_N + offset, dtype=dtype)[offset:]
    kernels.cast_(x, out)
    ref = x.to(dtype)
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        nan = torch.isnan(x)
        assert same_bits(out[~nan], ref[~nan]) and bool(torch.isnan(out[nan].float()).all())
    else:
        assert same_bits(out, ref)


@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_streamed_16_to_f32_all_values(isa, offset, dtype):
    reps = (4 << 20) // (4 << 16) + 1  # every 16-bit pattern, > 4 MiB of fp32 output
    h = all_16bit(dtype).repeat(reps)
    h = torch.cat([h, h[:offset + 17]])[offset:]
    out = torch.empty(h.numel() + offset, dtype=torch.float32)[offset:]
    kernels.cast_(h, out)
    assert same_bits(out, h.float())


@pytest.mark.parametrize("offset", [0, 1])
def test_streamed_bf16_f16_cross_cast(isa, gen, offset):
    h = torch.randn(STREAM_N + offset, generator=gen).to(torch.bfloat16)[offset:]
    out = torch.empty(STREAM_N + offset, dtype=torch.float16)[offset:]
    kernels.cast_(h, out)
    assert same_bits(out, h.float().to(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_copy(gen, dtype):
    src = torch.randint(-1000, 1000, (1_000_003,), generator=gen).to(dtype)
    dst = torch.empty_like(src)
    assert torch.equal(kernels.copy_(dst, src), src)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_matches_fp32_sequential(isa, gen, n, dtype):
    srcs = [torch.randn(n, generator=gen).to(dtype) for _ in range(3)]
    out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    kernels.sum_(srcs, out)
    fallback.sum_(srcs, ref)
    assert same_bits(out, ref)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sumsq(isa, gen, n, dtype):
    x = torch.randn(n, generator=gen).to(dtype)
    exact = fallback.sumsq(x)
    # fp32 lane sums over 4096-element blocks: relative error ~ 4096 * 2^-24 worst
    # case, far less in practice; 1e-5 leaves room and still catches a wrong sum.
    assert kernels.sumsq(x) == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_has_nonfinite(isa, gen, n, dtype):
    x = torch.randn(n, generator=gen).to(dtype)
    assert not kernels.has_nonfinite(x)
    for bad in (float("inf"), -float("inf"), float("nan")):
        for pos in {0, n // 2, n - 1}:
            y = x.clone()
            y[pos] = bad
            assert kernels.has_nonfinite(y), (bad, pos)
