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
