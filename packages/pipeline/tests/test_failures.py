"""A failing stage makes every other stage raise a clear PipelineError within the comm timeout.

Two failures on 3 ranks (1F1B, 6 microbatches): stage 1 is killed outright
(os._exit in the middle of a forward) and, in a second job, stage 1 raises an
exception in a forward and its process ends. The survivors must raise
PipelineError naming their stage, the instruction they were running and the
lost neighbour, well within the comm timeout, never hang.
"""

from __future__ import annotations

import os
import time
from functools import partial

import torch
from torch import nn

from capstan.comm.testing import run_ranks
from capstan.pipeline import LayerSpec, PipelineError, PipelineExecutor, make_schedule, partition

COMM_TIMEOUT = 20.0


class Faulty(nn.Module):
    """A linear layer that, on rank `victim`, dies or raises on its `at`-th forward call."""

    def __init__(self, victim: int, at: int, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.victim, self.at, self.how, self.calls = victim, at, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from capstan import comm

        self.calls += 1
        if comm.world().rank == self.victim and self.calls == self.at:
            if self.how == "kill":
                os._exit(17)
            raise ValueError("injected failure in forward")
        return self.lin(x)


def _run(how: str) -> tuple[str, str, float, int, list[int]]:
    from capstan import comm

    groups = comm.build_groups(comm.Topology(pp=3))
    specs = [LayerSpec(partial(Faulty, 1, 3, how), f"faulty{i}") for i in range(3)]
    ex = PipelineExecutor(
        partition(specs, 3, "uniform"),
        make_schedule("1f1b", 3, 6),
        groups,
        lambda y, t: ((y - t) ** 2).mean(),
        seed=0,
    )
    xs = [torch.randn(2, 4) for _ in range(6)]
    start = time.monotonic()
    try:
        ex.step(xs, xs)
    except PipelineError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start, exc.stage, exc.lost_stages
    return "no error", "", time.monotonic() - start, -1, []


def _assert_clear(results: list, survivors: list[int]) -> None:
    for r in survivors:
        kind, msg, elapsed, stage, lost = results[r]
        assert kind == "PipelineError", (r, results[r])
        assert msg.startswith(f"pipeline stage {r} failed at "), msg
        assert any(
            w in msg for w in ("RecvActivation", "RecvGrad", "SendActivation", "SendGrad")
        ), msg
        assert elapsed < COMM_TIMEOUT, (r, elapsed)  # the dead peer surfaces before the timeout
        assert stage == r
        assert lost, msg  # names the stage(s) that went away


def test_killed_stage_makes_the_others_raise_naming_stage_and_instruction() -> None:
    results = run_ranks(_run, 3, "kill", timeout=120, comm_timeout=COMM_TIMEOUT, tolerate_dead=(1,))
    assert results[1] is None
    _assert_clear(results, [0, 2])
    # The killed stage is named; a survivor that has already given up and exited may be named too.
    assert 1 in results[0][4] and 1 in results[2][4], results


def test_raising_stage_reports_its_instruction_and_the_others_fail_cleanly() -> None:
    results = run_ranks(_run, 3, "raise", timeout=120, comm_timeout=COMM_TIMEOUT)
    kind, msg, _, stage, _ = results[1]
    assert kind == "PipelineError" and stage == 1
    assert "pipeline stage 1 failed at Forward(mb=" in msg and "injected failure" in msg, msg
    _assert_clear(results, [0, 2])
