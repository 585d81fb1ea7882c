"""The stand-in device (capstan.native.standin) behaves like an accelerator that is not the CPU.

Everything runs in one fresh process (the stand-in takes torch's PrivateUse1 slot and makes
torch.accelerator see a device, which the rest of this pytest process must not inherit); the
tests below each check one part of what it returned.
"""

from __future__ import annotations

import pytest

from capstan.comm.testing import run_ranks
from capstan.native import standin

pytestmark = pytest.mark.skipif(
    not standin.available(), reason="no stand-in device here (it needs torch's C++ headers and a C++ compiler)"
)


def _battery() -> dict:
    import torch

    from capstan.native import standin

    out: dict = {"name": standin.load()}
    module = torch.get_device_module("standin")
    try:  # before anything touched the device: CUDA raises here (first GPU lease)
        module.reset_peak_memory_stats(0)
        out["reset_before_init"] = None
    except RuntimeError as exc:
        out["reset_before_init"] = str(exc)
    out["initialized_before"] = module.is_initialized()
    x = torch.ones(4, device="standin")
    out["initialized_after"] = module.is_initialized()
    module.reset_peak_memory_stats(0)  # raises no more
    with module.device(1):
        out["device_context"] = (module.current_device(), str(torch.ones(1, device="standin").device))
    out["device_after_context"] = module.current_device()
    out["device"] = str(x.device)
    out["index"] = x.device.index
    out["accelerator"] = str(torch.accelerator.current_accelerator())
    out["count"] = torch.accelerator.device_count()
    out["sum"] = float((x * 2 + 1).sum())
    out["sum_device"] = str((x * 2).sum().device)
    try:
        x + torch.ones(4)
        out["mix"] = None
    except RuntimeError as exc:
        out["mix"] = str(exc)
    try:
        torch.mm(torch.ones(2, 2, device="standin"), torch.ones(2, 2))
        out["mix_mm"] = None
    except RuntimeError as exc:
        out["mix_mm"] = str(exc)
    try:
        torch.ones(2, device="standin:0") + torch.ones(2, device="standin:1")
        out["mix_index"] = None
    except RuntimeError as exc:
        out["mix_index"] = str(exc)
    out["scalar_ok"] = str((x + torch.tensor(3.0)).device)
    out["cpu_index_ok"] = str(torch.arange(8.0, device="standin")[torch.tensor([1, 3])].cpu().tolist())

    # Values: the CPU's, bit for bit (the same kernels, the same random stream).
    torch.manual_seed(3)
    a = torch.randn(16, 8)
    lin = torch.nn.Linear(8, 4)
    ref = torch.nn.functional.gelu(lin(a)).sum()
    ref.backward()
    ref_grad = lin.weight.grad.clone()
    lin.zero_grad()
    dlin = torch.nn.Linear(8, 4).to("standin")
    dlin.load_state_dict(lin.state_dict())
    got = torch.nn.functional.gelu(dlin(a.to("standin"))).sum()
    got.backward()
    out["forward_equal"] = bool(torch.equal(got.cpu(), ref.detach()))
    ln = torch.nn.LayerNorm(8)  # an op with a generic kernel beside the CPU's: the stand-in takes the CPU's
    out["layer_norm_equal"] = bool(torch.equal(ln(a), torch.nn.LayerNorm(8).to("standin")(a.to("standin")).cpu()))
    out["grad_equal"] = bool(torch.equal(dlin.weight.grad.cpu(), ref_grad))
    out["grad_device"] = str(dlin.weight.grad.device)
    torch.manual_seed(7)
    r_cpu = torch.randn(5)
    torch.manual_seed(7)
    r_dev = torch.randn(5, device="standin")
    out["random_equal"] = bool(torch.equal(r_cpu, r_dev.cpu()))

    with torch.autocast("standin", dtype=torch.bfloat16):  # CUDA's autocast policy
        out["autocast"] = (str((x.reshape(2, 2) @ x.reshape(2, 2)).dtype), str(torch.exp(x.bfloat16()).dtype))

    # In-place ops write the device tensor's memory; an out= that must resize moves the result.
    y = torch.zeros(3, device="standin")
    y.add_(2)
    out["inplace"] = y.cpu().tolist()
    z = torch.empty(0, device="standin")
    torch.mul(torch.ones(5, device="standin"), 3, out=z)
    out["resized_out"] = (z.cpu().tolist(), str(z.device))

    # Streams and events (immediate), as torch's device-generic API gives them.
    s = torch.Stream(device="standin")
    e = torch.Event(device="standin", enable_timing=True)
    e2 = torch.Event(device="standin", enable_timing=True)
    e.record(s)
    e2.record(s)
    out["event"] = (e.query(), e.elapsed_time(e2) >= 0, str(s.device))
    out["stream_set"] = str(torch.accelerator.current_stream().device)

    # The caching device allocator: reserved stays above allocated after a free, until empty_cache.
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats(0)
    before = torch.accelerator.memory_allocated(0)
    big = torch.empty(1000, device="standin")  # 4000 bytes -> a 4096-byte block
    mid = torch.accelerator.memory_allocated(0) - before
    del big
    out["alloc"] = (mid, torch.accelerator.memory_allocated(0) - before,
                    torch.accelerator.memory_reserved(0) >= 4096,
                    torch.accelerator.max_memory_allocated(0) - before)
    torch.accelerator.empty_cache()
    out["reserved_after_empty"] = (torch.accelerator.memory_reserved(0), torch.accelerator.memory_allocated(0))
    out["module_allocated"] = torch.get_device_module("standin").memory_allocated(0) == \
        torch.accelerator.memory_allocated(0)

    # Pinned host memory: power-of-two blocks, cached when freed.
    standin.empty_host_cache()
    p = torch.empty(5000, dtype=torch.uint8, pin_memory=True)
    q = torch.empty(10, pin_memory=False)
    hs = standin.host_stats()
    out["pinned"] = (p.is_pinned(), q.is_pinned(), hs["allocated"], hs["requested"])
    del p
    out["pinned_cached"] = standin.host_stats()["reserved"]

    # Out of memory past the configured capacity, as torch.OutOfMemoryError.
    try:
        torch.empty(1 << 20, device="standin")
        out["oom"] = None
    except torch.OutOfMemoryError as exc:
        out["oom"] = str(exc)
    return out


@pytest.fixture(scope="module")
def battery() -> dict:
    env = {"CAPSTAN_STANDIN_DEVICES": "2", "CAPSTAN_STANDIN_MEMORY": str(1 << 20)}
    return run_ranks(_battery, 1, init=False, env=env, timeout=240)[0]


def test_tensors_report_their_own_device(battery):
    assert battery["name"] == "standin"
    assert battery["device"] == "standin:0" and battery["index"] == 0
    assert battery["accelerator"] == "standin" and battery["count"] == 2
    assert battery["sum"] == 12.0 and battery["sum_device"] == "standin:0"


def test_mixing_with_cpu_raises_as_cuda_does(battery):
    assert battery["mix"] and "same device" in battery["mix"]
    assert battery["mix_mm"] and "same device" in battery["mix_mm"]
    assert battery["mix_index"] and "same device" in battery["mix_index"]
    # what CUDA allows: a 0-dim CPU tensor as a scalar, CPU index tensors
    assert battery["scalar_ok"] == "standin:0"
    assert battery["cpu_index_ok"] == "[1.0, 3.0]"


def test_computes_the_cpu_values_bit_for_bit(battery):
    assert battery["forward_equal"] and battery["grad_equal"] and battery["random_equal"]
    assert battery["layer_norm_equal"]
    assert battery["autocast"] == ("torch.bfloat16", "torch.float32")  # matmul lowered, exp kept in fp32
    assert battery["grad_device"] == "standin:0"
    assert battery["inplace"] == [2.0, 2.0, 2.0]
    assert battery["resized_out"] == ([3.0] * 5, "standin:0")


def test_streams_and_events(battery):
    assert battery["event"][0] is True and battery["event"][1] is True and battery["event"][2] == "standin:0"
    assert battery["stream_set"] == "standin:0"


def test_device_allocator_counts_allocated_and_reserved(battery):
    allocated, after_free, reserved, peak = battery["alloc"]
    assert allocated == 4096  # rounded to 512-byte blocks
    assert after_free == 0 and reserved and peak == 4096
    reserved_now, allocated_now = battery["reserved_after_empty"]
    assert reserved_now == allocated_now  # empty_cache gave the cached blocks back
    assert battery["module_allocated"]


def test_pinned_memory_rounds_to_powers_of_two(battery):
    pinned, unpinned, allocated, requested = battery["pinned"]
    assert pinned and not unpinned
    assert requested == 5000 and allocated == 8192
    assert battery["pinned_cached"] >= 8192  # freed blocks stay reserved


def test_out_of_memory_past_capacity(battery):
    assert battery["oom"] and "standin out of memory" in battery["oom"]


def test_memory_statistics_need_an_initialized_device_as_on_cuda(battery: dict) -> None:
    """torch.cuda.reset_peak_memory_stats raises "Invalid device argument" before CUDA is initialized (it
    failed every measurement of the first GPU lease): the stand-in raises there too, and not after."""
    assert battery["initialized_before"] is False and battery["initialized_after"] is True
    assert "Invalid device argument" in battery["reset_before_init"]


def test_device_context_selects_a_device_and_restores_the_current_one(battery: dict) -> None:
    assert battery["device_context"] == (1, "standin:1")
    assert battery["device_after_context"] == 0
