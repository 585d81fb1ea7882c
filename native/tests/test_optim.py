"""CPUAdam: a drop-in for torch.optim.AdamW/Adam with torch's state_dict layout."""

from __future__ import annotations

import copy

import pytest
import torch

from capstan.native.optim import CPUAdam


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 5))


def train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 13, generator=g)
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("adamw", [True, False])
def test_matches_torch_optimizer(adamw):
    a, b = make_model(0), make_model(0)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = cls(a.parameters(), lr=1e-2, weight_decay=0.05)
    ours = CPUAdam(b.parameters(), lr=1e-2, weight_decay=0.05, adamw_mode=adamw)
    train(a, ref, 30)
    train(b, ours, 30)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-7)


def test_state_dict_round_trips_with_torch():
    a, b = make_model(1), make_model(1)
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ours = CPUAdam(b.parameters(), lr=1e-2)
    train(a, ref, 5)
    train(b, ours, 5)
    sd = ours.state_dict()
    ref_sd = ref.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for k, st in sd["state"].items():
        assert set(st) == set(ref_sd["state"][k]) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["step"].dtype == ref_sd["state"][k]["step"].dtype
    # torch -> CPUAdam and CPUAdam -> torch, then training continues identically.
    c, d = make_model(2), make_model(2)
    c.load_state_dict(a.state_dict())
    d.load_state_dict(a.state_dict())
    ours2 = CPUAdam(c.parameters(), lr=1e-2)
    ours2.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref2 = torch.optim.AdamW(d.parameters(), lr=1e-2)
    # deep copies: state_dict() shares the moment tensors with the optimizer
    ref2.load_state_dict(copy.deepcopy(ours2.state_dict()))
    train(c, ours2, 5, seed=9)
    train(d, ref2, 5, seed=9)
    for pc, pd in zip(c.parameters(), d.parameters()):
        torch.testing.assert_close(pc, pd, rtol=1e-5, atol=1e-7)


def test_rejects_non_cpu_fp32_params():
    with pytest.raises(ValueError, match="fp32 cpu params"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))


def test_bf16_states_keep_the_moments_in_bf16_and_train_like_fp32():
    a, b = make_model(3), make_model(3)
    full = CPUAdam(a.parameters(), lr=1e-2, weight_decay=0.05)
    half = CPUAdam(b.parameters(), lr=1e-2, weight_decay=0.05, state_dtype=torch.bfloat16)
    train(a, full, 50)
    train(b, half, 50)
    for st in half.state.values():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=2e-2, atol=2e-3)  # stochastic rounding's noise, not bits
    assert any(not torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    # a state_dict of fp32 moments (torch's, or this run's) loads and stays bf16 from the next step on
    c = make_model(3)
    c.load_state_dict(a.state_dict())
    again = CPUAdam(c.parameters(), lr=1e-2, weight_decay=0.05, state_dtype=torch.bfloat16)
    again.load_state_dict(copy.deepcopy(full.state_dict()))
    train(c, again, 1)
    assert all(st["exp_avg"].dtype == torch.bfloat16 for st in again.state.values())
    with pytest.raises(ValueError, match="state_dtype"):
        CPUAdam(c.parameters(), state_dtype=torch.float16)
    with pytest.raises(ValueError, match="state_dtype"):
        CPUAdam(c.parameters(), state_dtype=torch.int8)


def test_8bit_states_keep_codes_and_scales_and_train_like_fp32():
    """state_dtype=torch.uint8: the moments as 8-bit codes with a scale per block of 256 (a quarter of the
    bytes), training close to fp32 AdamW; a torch fp32 state_dict loads in, and an 8-bit one loads into an
    fp32 CPUAdam as its exact values, and back into the same codes."""
    a, b = make_model(4), make_model(4)
    full = CPUAdam(a.parameters(), lr=1e-2, weight_decay=0.05)
    small = CPUAdam(b.parameters(), lr=1e-2, weight_decay=0.05, state_dtype=torch.uint8)
    train(a, full, 50)
    train(b, small, 50)
    for p in b.parameters():
        st = small.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.uint8 and st["exp_avg"].shape == p.shape
        assert st["exp_avg_scale"].numel() == -(-p.numel() // 256) and bool(st["exp_avg_scale"].any())
    # quantization noise, not bits: after 50 steps of lr 1e-2 (a path of up to 0.5 per weight) the weights
    # are within 3 steps' worth of fp32's (measured 0.020; bitsandbytes' AdamW8bit on every parameter 0.010,
    # bf16 moments 0.0017)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=0, atol=3e-2)
    assert any(not torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    # 8-bit -> fp32 CPUAdam (exact values) -> 8-bit again: the same codes and scales
    wide = CPUAdam(make_model(4).parameters(), lr=1e-2, state_dtype=torch.float32)
    wide.load_state_dict(copy.deepcopy(small.state_dict()))
    narrow = CPUAdam(make_model(4).parameters(), lr=1e-2, state_dtype=torch.uint8)
    narrow.load_state_dict(copy.deepcopy(small.state_dict()))
    for (pw, pn), p in zip(zip(wide.param_groups[0]["params"], narrow.param_groups[0]["params"]), b.parameters()):
        wide._convert_moments(pw, wide.state[pw])
        assert wide.state[pw]["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in wide.state[pw]
        back = CPUAdam([torch.nn.Parameter(pw.detach().clone())], state_dtype=torch.uint8)
        q = back._init_state(back.param_groups[0]["params"][0])
        q.update({k: t.clone() for k, t in wide.state[pw].items()})
        q.pop("exp_avg_scale", None)
        q.pop("exp_avg_sq_scale", None)
        back._convert_moments(back.param_groups[0]["params"][0], q)
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            assert torch.equal(q[key], small.state[p][key]), key
            assert torch.equal(narrow.state[pn][key], small.state[p][key]), key  # loaded as they were
    # torch's own fp32 state_dict loads into the 8-bit optimizer and training goes on
    c = make_model(4)
    c.load_state_dict(a.state_dict())
    again = CPUAdam(c.parameters(), lr=1e-2, weight_decay=0.05, state_dtype=torch.uint8)
    again.load_state_dict(copy.deepcopy(full.state_dict()))
    train(c, again, 1)
    assert all(st["exp_avg"].dtype == torch.uint8 for st in again.state.values())
