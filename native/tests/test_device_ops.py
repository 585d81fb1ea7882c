"""The kernels' contract on a GPU (device_ops.py: torch's fused Adam), checked on the CPU where torch
has the same fused kernel, and on a real GPU where there is one."""

from __future__ import annotations

import pytest
import torch

from capstan.comm.testing import requires_cuda
from capstan.native import device_ops, kernels, standin

HP = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def _state(n: int, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    return [t.to(device) for t in (p, grad, m, v)]


@pytest.mark.parametrize("adamw,wd,scale", [(True, 0.1, 1.0), (True, 0.0, 0.25), (False, 0.1, 0.5)])
def test_fused_adam_matches_the_native_kernel(adamw: bool, wd: float, scale: float) -> None:
    """One step of torch's fused kernel (what a GPU runs) vs the CPU kernel, to float rounding."""
    assert device_ops.fused_available(torch.device("cpu"))
    ref = _state(10_000, 0)
    got = [t.clone() for t in ref]
    kernels.adam_update(*ref, **HP, weight_decay=wd, adamw=adamw, grad_scale=scale)
    device_ops.adam_step(*got, **HP, weight_decay=wd, adamw=adamw, grad_scale=scale)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), (ref[0], ref[2], ref[3]), (got[0], got[2], got[3])):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-7, msg=name)
    if scale != 1.0:  # the fused kernel leaves the gradient unscaled in place (documented)
        torch.testing.assert_close(got[1], ref[1] * scale)


def test_one_fused_call_over_pieces_steps_each_as_its_own_call() -> None:
    """adam_step_fused: pieces of one buffer in one multi-tensor call, the same bits as a call per piece (the
    update is element-wise), the gradients left scaled alike."""
    ref = _state(10_000, 9)
    got = [t.clone() for t in ref]
    pieces = [slice(0, 3000), slice(3000, 3001), slice(5000, 10_000)]
    hp = dict(**HP, weight_decay=0.1, adamw=True, grad_scale=0.5)
    for s in pieces:
        device_ops.adam_step(*(t[s] for t in ref), **hp)
    device_ops.adam_step_fused(*([t[s] for s in pieces] for t in got), **hp)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    with pytest.raises(ValueError, match="lists of one length"):
        device_ops.adam_step_fused([got[0]], [], [got[2]], [got[3]], **hp)


def test_overflow_changes_nothing_and_cast_out() -> None:
    p, g, m, v = _state(64, 1)
    g[5] = float("inf")
    before = [t.clone() for t in (p, m, v)]
    assert device_ops.adam_step(p, g, m, v, **HP, weight_decay=0.0, adamw=True, check_overflow=True)
    assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v)))
    p, g, m, v = _state(64, 2)
    out = torch.empty(64, dtype=torch.bfloat16)
    device_ops.adam_step(p, g, m, v, **HP, weight_decay=0.0, adamw=True, out=out)
    assert torch.equal(out, p.to(torch.bfloat16))


def test_sumsq_to_fp32_rounding() -> None:
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(3))
    assert device_ops.sumsq(x) == pytest.approx(float(x.double().square().sum()), rel=1e-6)
    assert device_ops.sumsq(x) == pytest.approx(kernels.sumsq(x), rel=1e-6)  # the CPU kernel sums fp32 blocks
    assert device_ops.sumsq(torch.empty(0)) == 0.0
    y = x.to(torch.bfloat16)  # a bf16 master's gradient: its squares summed in fp32 as the CPU kernel's are
    assert device_ops.sumsq(y) == pytest.approx(float(y.double().square().sum()), rel=2e-6)
    assert device_ops.sumsq(y) == pytest.approx(kernels.sumsq(y), rel=1e-7)


def _allocated(fn) -> int:  # noqa: ANN001
    """Bytes `fn()` allocated on the CPU, temporaries inside ATen's kernels included (the profiler sees the
    allocator; the stand-in's device statistics would not: it runs an op's kernel on host memory)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_copies_no_gradient(dtype: torch.dtype) -> None:
    """A gradient norm allocates a few bytes a row of NORM_ROW elements, not a float64 copy of the gradient:
    `vector_norm(x, dtype=torch.float64)` converts its whole input before reducing, in ATen's reduction
    code that the CPU and CUDA share (8 bytes an element, measured here as the premise). On the CPU a bf16
    gradient is widened to fp32 first (4 bytes an element); CUDA widens 16-bit inputs inside the kernel."""
    n = 1 << 20
    x = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert _allocated(lambda: torch.linalg.vector_norm(x, 2, dtype=torch.float64)) >= 8 * n  # the old way
    rows = 16 * n // device_ops.NORM_ROW + 4096
    got = _allocated(lambda: device_ops.sumsq_tensor(x))
    assert got <= (rows if dtype == torch.float32 else 4 * n + rows), got
    assert float(device_ops.sumsq_tensor(x)) == pytest.approx(float(x.double().square().sum()), rel=2e-6)


def test_the_overflow_check_copies_no_gradient() -> None:
    """An accelerator's overflow check (fp16's, and int8 compression's before quantizing) reads a flag off
    the row norms, not a bool per element (`torch.isfinite(x).all()`: 1 byte an element at the step's peak,
    measured here as the premise): inf and NaN anywhere, the tail row included, are found, and a finite
    gradient is not."""
    n = 1 << 20
    x = torch.randn(n + 5, generator=torch.Generator().manual_seed(6))
    assert _allocated(lambda: torch.isfinite(x).all()) >= n  # the old way
    assert _allocated(lambda: device_ops.nonfinite_tensor(x)) <= 16 * n // device_ops.NORM_ROW + 4096
    assert not bool(device_ops.nonfinite_tensor(x))
    for where, bad in ((0, float("inf")), (n // 2, float("-inf")), (n + 4, float("nan"))):
        y = x.clone()
        y[where] = bad
        assert bool(device_ops.nonfinite_tensor(y)) and bool(device_ops.nonfinite_tensor(y.to(torch.bfloat16)))


def test_devices_must_agree() -> None:
    p, g, m, v = _state(16, 4)
    with pytest.raises(ValueError, match="^param must be on the cpu or an accelerator"):
        kernels.adam_update(p.to("meta"), g, m, v, **HP)
    with pytest.raises(ValueError, match="^src must be on the cpu or an accelerator"):
        kernels.cast_(p.to("meta"), torch.empty(16))


@requires_cuda()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_on_a_gpu_match_the_cpu(dtype: torch.dtype) -> None:
    cpu = _state(1 << 20, 5)
    cpu[1] = cpu[1].to(dtype)
    gpu = [t.to("cuda") for t in cpu]
    out = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    kernels.adam_update_and_cast(*gpu, out, **HP, weight_decay=0.1, grad_scale=0.5)
    kernels.adam_update(*cpu, **HP, weight_decay=0.1, grad_scale=0.5)
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.cpu(), cpu[0].to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    assert kernels.sumsq(gpu[2]) == pytest.approx(kernels.sumsq(cpu[2]), rel=1e-5)
    assert not kernels.has_nonfinite(gpu[0])
    gpu[0][7] = float("nan")
    assert kernels.has_nonfinite(gpu[0])
    with pytest.raises(ValueError, match="^grad must be on cuda"):
        kernels.adam_update(gpu[0], cpu[1], gpu[2], gpu[3], **HP)


@standin.requires()
@pytest.mark.parametrize("moments,master", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            ("int8", torch.float32), ("int8", torch.bfloat16)])
def test_the_device_fallback_steps_in_windows_with_the_same_bits_and_bounded_memory(monkeypatch, moments,
                                                                                       master) -> None:
    """On a device, bf16 and 8-bit moments and a bf16 master step through fallback.py's torch ops, whose
    temporaries came to 65-81 bytes an element of the whole tensor (84 GB for a 1.3B flat shard). They
    step a window at a time: the same bits as one pass, and on the stand-in device the memory a step
    allocates beyond its tensors is bounded by the window, not the tensor."""
    from capstan.native import fallback, q8

    dev = standin.load()
    n, block = 12 * 4096 + 77, 256
    segments = [(0, 7 * 4096 + 5, 0), (7 * 4096 + 5, 5 * 4096 + 72, 7 * 4096 + 5)]
    args = dict(**HP, weight_decay=0.01, adamw=True, seed=11)

    def run(window: int, device: str) -> tuple[list[torch.Tensor], int]:
        """The state after one step with `window`, and (on the stand-in) the bytes it allocated at its peak
        beyond the tensors it was given."""
        monkeypatch.setattr(fallback, "WINDOW", window)
        p, g, m, v = _state(n, 7)
        if moments == "int8":
            codes = [q8.quantize(torch.cat([t[o:o + k] for o, k, _ in segments]), f, block)[0] for t, f in
                     ((m, "exp_avg"), (v, "exp_avg_sq"))]
            scales = [torch.cat([q8.quantize(t[o:o + k], f, block)[1] for o, k, _ in segments]) for t, f in
                      ((m, "exp_avg"), (v, "exp_avg_sq"))]
            state = [t.to(device) for t in (p.to(master), g, *codes, *scales)]
        else:
            state = [t.to(device) for t in (p.to(master), g, m.to(moments), v.to(moments))]
        mod = getattr(torch, dev)
        mod.reset_peak_memory_stats()
        base = mod.memory_allocated()
        if moments == "int8":
            fallback.adam_step_q8(*state, block=block, segments=segments, **args)
        else:
            fallback.adam_step(*state, **args)
        return [t.cpu() for t in state], mod.max_memory_allocated() - base

    whole, whole_extra = run(1 << 30, dev)
    windowed, extra = run(4096, dev)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(whole, windowed))
    assert whole_extra > 40 * n  # one pass over every element
    assert extra <= 96 * 4096 < whole_extra / 4, (extra, whole_extra)  # fallback.WINDOW_BYTES at this window


@standin.requires()
def test_an_accelerators_overflow_check_reads_the_row_norms(monkeypatch) -> None:
    """kernels.has_nonfinite on an accelerator goes through device_ops.nonfinite_tensor (no bool per
    element), never the fallback's `torch.isfinite(x).all()`; inf and NaN are found, finite values are not."""
    from capstan.native import fallback

    device = torch.device(standin.load(), 0)
    monkeypatch.setattr(fallback, "has_nonfinite", lambda *a, **k: pytest.fail("the fallback ran"))
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(7)).to(device)
    assert not kernels.has_nonfinite(x) and not kernels.has_nonfinite(x.to(torch.bfloat16))
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[9_999] = bad
        assert kernels.has_nonfinite(y) and kernels.has_nonfinite(y.to(torch.bfloat16))
