"""The "time" partition: measured forward + backward per layer, one layer built at a time, and one
answer for every member of a group (timings differ between processes)."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch
from torch import nn

from capstan import comm
from capstan.comm.testing import run_ranks
from capstan.pipeline import LayerSpec, PartitionError, layer_times, partition

ALIVE = {"now": 0, "most": 0}


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Sleepy(nn.Module):
    """A layer whose forward and backward each take `ms` milliseconds, with `n` parameters."""

    def __init__(self, ms: float, n: int) -> None:
        super().__init__()
        self.seconds, self.w = ms / 1000, nn.Parameter(torch.zeros(n))
        if not self.w.is_meta:
            ALIVE["now"] += 1
            ALIVE["most"] = max(ALIVE["most"], ALIVE["now"])

    def __del__(self) -> None:
        if not self.w.is_meta:
            ALIVE["now"] -= 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.seconds) + self.w.sum()


def _specs(costs_ms: list[float], params: list[int]) -> list[LayerSpec]:
    return [LayerSpec(partial(Sleepy, ms, n), f"l{i}") for i, (ms, n) in enumerate(zip(costs_ms, params, strict=True))]


def test_time_balances_measured_cost_where_parameters_would_not() -> None:
    # The last layer is slow and small; the others fast and large.
    specs = _specs([10, 10, 10, 10, 40], [1000, 1000, 1000, 1000, 10])
    x = torch.zeros(2, 4)
    ALIVE.update(now=0, most=0)
    times = layer_times(specs, x, repeats=2)
    assert ALIVE["most"] == 1, "layers must be built and timed one at a time"
    assert all(t >= 0.02 for t in times[:4]) and times[4] >= 0.08  # forward + backward sleeps
    assert partition(specs, 2, "time", example=x).bounds == (0, 4, 5)
    assert partition(specs, 2, "parameters").bounds == (0, 2, 5)
    with pytest.raises(PartitionError, match="'time' needs `example`"):
        partition(specs, 2, "time")


def test_integer_inputs_take_no_gradient() -> None:
    """An embedding-like first layer gets token ids: no gradient for them, and the next layer is fed
    the floating output."""
    from capstan.pipeline.testing_models import gpt_specs

    specs = gpt_specs(vocab=64, hidden=16, layers=2, heads=2, seq=8)
    times = layer_times(specs, torch.zeros(2, 8, dtype=torch.long), repeats=1)
    assert len(times) == 4 and all(t > 0 for t in times)


def test_already_built_layers_keep_their_gradients_and_buffers() -> None:
    """Factories returning the caller's own modules (an nn.Sequential's children): timing them leaves
    their gradients, running statistics and the random state as they were."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 4)
    rng = torch.random.get_rng_state()
    specs = [LayerSpec(lambda m=m: m) for m in model]
    assert len(layer_times(specs, x, repeats=2)) == 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert model[3].weight.grad is None
    assert torch.equal(torch.random.get_rng_state(), rng)


def _agreed(rank_costs: list[list[float]]) -> tuple[int, ...]:
    group = comm.build_groups(comm.Topology(pp=2)).pp
    specs = _specs(rank_costs[group.rank], [1] * 5)
    return partition(specs, 2, "time", example=torch.zeros(2, 4), group=group).bounds


def test_group_members_get_the_first_members_timings() -> None:
    """Rank 1's layers alone would split (0, 1, 5); with the group both ranks use rank 0's timings."""
    costs = [[5, 5, 5, 5, 30], [30, 5, 5, 5, 5]]
    assert run_ranks(_agreed, 2, costs, timeout=120) == [(0, 4, 5), (0, 4, 5)]
