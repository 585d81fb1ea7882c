"""Measured 1F1B bubble on 4 real ranks against theory, (p-1)/(m+p-1).

Each stage is one layer whose forward sleeps F seconds and whose backward
sleeps 2F (an autograd Function), so the timing is set by the schedule and
not by how busy this shared 2-core machine is. A stage's idle fraction is
1 - (its time in Forward and Backward) / (the step's wall time between two
barriers). Theory (GPipe paper, section 2.3; PipeDream-Flush has the same
bubble) ignores communication; the test allows 10% of the theoretical value.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import nn

from capstan.comm.testing import run_ranks
from capstan.pipeline import LayerSpec, PipelineExecutor, make_schedule, partition

FORWARD_S = 0.08
STAGES, MICROBATCHES = 4, 8


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(2 * ctx.seconds)  # backward costs twice the forward, as for matmul layers
        return grad, grad.sum().reshape(1), None


class SleepLayer(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.w, self.seconds)


def _measure(schedule: str) -> list[float]:
    from capstan import comm

    groups = comm.build_groups(comm.Topology(pp=STAGES))
    specs = [LayerSpec(partial(SleepLayer, FORWARD_S), f"sleep{i}") for i in range(STAGES)]
    ex = PipelineExecutor(
        partition(specs, STAGES, "uniform"),
        make_schedule(schedule, STAGES, MICROBATCHES),
        groups,
        lambda y, t: ((y - t) ** 2).mean(),
    )
    xs = [torch.randn(2, 8) for _ in range(MICROBATCHES)]
    idle = []
    for _ in range(2):  # the first step negotiates shapes and warms up; measure the second
        comm.barrier(groups.pp)
        start = time.perf_counter()
        ex.step(xs, xs)
        comm.barrier(groups.pp)
        wall = time.perf_counter() - start
        idle.append(1.0 - (ex.times["forward"] + ex.times["backward"]) / wall)
    return idle


def test_1f1b_idle_fraction_matches_theory() -> None:
    theory = (STAGES - 1) / (MICROBATCHES + STAGES - 1)
    results = run_ranks(_measure, STAGES, "1f1b", timeout=120)
    for stage, idle in enumerate(r[-1] for r in results):
        assert abs(idle - theory) <= 0.1 * theory, (
            f"stage {stage}: idle {idle:.3f}, theory {theory:.3f}"
        )
