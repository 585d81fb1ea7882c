"""Mixed precision in chunks: 16-bit parameters, fp32 masters, gradient slot reuse, fp16 overflow."""

from __future__ import annotations

import pytest
import torch

from capstan.chunkmem import ChunkAdam, ChunkedModel, ChunkKind, ChunkManager, DiskStore, DynamicLossScaler
from capstan.comm.testing import BF16_VS_CPU, cpu_arithmetic, cuda_param
from capstan.native import standin

CHUNK = 4096
STEPS = 10


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32),
        torch.nn.LayerNorm(32), torch.nn.Linear(32, 64),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (4, 8), generator=g)
    return x, (x * 3 + 1) % 64


def _loss(model: torch.nn.Module, step: int, device: str = "cpu") -> torch.Tensor:
    x, y = (t.to(device) for t in _batch(step))
    return torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 64), y.reshape(-1))


def _torch_bf16_reference() -> list[float]:
    """bf16 model + fp32 master copies + torch AdamW on the masters, cast back after each step."""
    model = _net()
    masters = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    out = []
    for s in range(STEPS):
        loss = _loss(model, s)
        loss.backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        for m, p in zip(masters, model.parameters()):
            p.data.copy_(m)
        out.append(loss.item())
    return out


def _chunked(tmp_path, budget: int | None, accumulate: bool, dtype=torch.bfloat16, device: str | None = None,
             device_budget: int | None = None) -> tuple[list[float], ChunkedModel]:
    manager = ChunkManager(budget, DiskStore(tmp_path) if tmp_path is not None else None, audit=True,
                           device=device, device_budget=device_budget)
    model = ChunkedModel(_net(), manager, CHUNK, dtype=dtype, accumulate_grads=accumulate)
    opt = ChunkAdam(model, lr=1e-2, weight_decay=0.1)
    out = []
    for s in range(STEPS):
        manager.begin_step()
        loss = _loss(model, s, device or "cpu")
        model.backward(loss)
        opt.step()
        manager.end_step()
        out.append(loss.item())
    return out, model


def test_bf16_chunks_follow_the_torch_master_weight_recipe(tmp_path) -> None:
    want = _torch_bf16_reference()
    got, model = _chunked(tmp_path, 10 * CHUNK * 4, accumulate=False)
    # Same values, same element-wise update; the native Adam follows ATen op by op.
    assert max(abs(a - b) / b for a, b in zip(got, want)) <= 1e-5, (got, want)
    assert want[-1] < want[0]
    assert model.kinds() == [ChunkKind.PARAM, ChunkKind.MASTER, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ]
    model.manager.close()


def test_gradient_slot_reuse_equals_separate_gradient_chunks(tmp_path) -> None:
    reuse, m1 = _chunked(tmp_path / "a", 10 * CHUNK * 4, accumulate=False)
    separate, m2 = _chunked(tmp_path / "b", 10 * CHUNK * 4, accumulate=True)
    assert reuse == separate  # bf16 gradients are exact in fp32: identical updates
    assert ChunkKind.GRAD in m2.kinds() and ChunkKind.GRAD not in m1.kinds()
    # Bytes per chunk slot: 2 (bf16) + 4 + 4 + 4 = 14 with reuse; + 4 for fp32 gradient chunks.
    per_elem = {k: m1.chunks[k][0][0].nbytes // CHUNK for k in m1.kinds()}
    assert sum(per_elem.values()) == 14
    assert sum(m2.chunks[k][0][0].nbytes // CHUNK for k in m2.kinds()) == 18
    m1.manager.close()
    m2.manager.close()


@pytest.mark.parametrize("accumulate", [False, True])
def test_chunks_that_stay_put_train_without_module_hooks_like_the_hooked_path(tmp_path, accumulate: bool) -> None:
    # RAM unbounded and no disk tier: nothing can move, so no access/release hooks are installed
    # (model.py `_chunks_stay_put`); the 16-bit gradients still reach their slots or chunks.
    hooked, m1 = _chunked(tmp_path, 10 * CHUNK * 4, accumulate=accumulate)
    static, m2 = _chunked(None, None, accumulate=accumulate)
    assert static == hooked
    assert not m1.static and m2.static
    assert all(not m._forward_pre_hooks for m in m2.module.modules())
    assert any(m._forward_pre_hooks for m in m1.module.modules())
    assert m2.manager.stats()["moved_bytes"] == 0
    m1.manager.close()


# "cpu": a device tier in RAM; "standin": an accelerator that is not the CPU (capstan.native.standin);
# "cuda" where there is a GPU (TF32 off: conftest.py)
DEVICES = ["cpu", standin.param(), cuda_param()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_bf16_chunks_through_a_device_tier_train_exactly_like_ram_only(tmp_path, device: str, accumulate: bool) -> None:
    # Slot reuse: the bf16 gradient lands in its parameter's slot on the device and reaches the
    # optimizer in RAM with it; with accumulation, fp32 gradient chunks are added to on the device.
    ram, m1 = _chunked(tmp_path / "ram", 10 * CHUNK * 4, accumulate=accumulate)
    budget = 2 * CHUNK * 4
    dev, m2 = _chunked(tmp_path / "dev", 10 * CHUNK * 4, accumulate=accumulate, device=device, device_budget=budget)
    if cpu_arithmetic(device):
        assert dev == ram  # the same arithmetic, moved around
    else:  # a GPU's bf16 kernels round in other orders: the trajectory, not the bits (testing/devices.py)
        assert dev == pytest.approx(ram, rel=BF16_VS_CPU), (dev, ram)
        assert dev[-1] < dev[0] - 1.0, dev  # and it learns (4.39 -> 2.21 on the CPU)
    tier = m2.manager.stats()["device" if device == "cpu" else device]
    assert tier["peak_bytes"] <= budget and tier["evictions"] > 0
    m1.manager.close()
    m2.manager.close()


def test_fp16_overflow_skips_the_step_and_restores_parameters(tmp_path) -> None:
    manager = ChunkManager(None, DiskStore(tmp_path), audit=True)
    model = ChunkedModel(_net(), manager, CHUNK, dtype=torch.float16)
    opt = ChunkAdam(model, lr=1e-2)
    before = {k: v.clone() for k, v in model.state_tensors().items()}
    params_before = [p.detach().clone() for p in model.module.parameters()]
    scaler = DynamicLossScaler(initial_scale=2.0**40, hysteresis=1)  # fp16 gradients overflow at this scale
    loss = _loss(model, 0)
    model.backward(loss * scaler.scale)
    _, overflow = opt.step(loss_scale=scaler.scale, check_overflow=True)
    scaler.update(overflow)
    assert overflow and scaler.scale == 2.0**39 and scaler.skipped == 1
    # Which parameters overflowed, named before their gradients were dropped: real names, each once.
    names = {n for n, _ in model.module.named_parameters()}
    assert opt.overflowed and set(opt.overflowed) <= names and len(set(opt.overflowed)) == len(opt.overflowed)
    after = model.state_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)  # masters untouched
    assert all(torch.equal(a, b) for a, b in zip(params_before, model.module.parameters()))  # restored
    # A sane scale then trains normally.
    scaler = DynamicLossScaler(initial_scale=128.0)
    loss = _loss(model, 1)
    model.backward(loss * scaler.scale)
    _, overflow = opt.step(loss_scale=scaler.scale, check_overflow=True)
    assert not overflow and not torch.equal(before["1.weight"], model.state_tensors()["1.weight"])
    assert opt.overflowed == []
    manager.close()


def test_loss_scaler_grows_after_a_clean_window() -> None:
    s = DynamicLossScaler(initial_scale=8.0, window=2, hysteresis=2, min_scale=2.0)
    s.update(True)
    assert s.scale == 8.0  # hysteresis: the first overflow is tolerated
    s.update(True)
    assert s.scale == 4.0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    for _ in range(6):
        s.update(True)
    assert s.scale == 2.0  # never below min_scale
    with pytest.raises(ValueError, match="invalid loss-scaling settings"):
        DynamicLossScaler(window=0)
