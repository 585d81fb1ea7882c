"""Every schedule, exhaustively, without processes: pairing, counts, no deadlock, memory, bubble.

Configurations: stages 1..8, microbatches 1..32, chunks 1..4 wherever the
schedule accepts them. Each is simulated with the executor's batching rules
(see simulate.py), which also proves every send meets its receive.
"""

from __future__ import annotations

from collections import Counter

import pytest

from capstan.pipeline import (
    Backward,
    Forward,
    GPipe,
    Interleaved1F1B,
    LoadMicrobatch,
    OneFOneB,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    ScheduleError,
    SendActivation,
    SendGrad,
    make_schedule,
    render_timeline,
    simulate,
)
from capstan.pipeline.schedule.simulate import Deadlock, SimulationError


def _configs():
    for p in range(1, 9):
        for m in range(1, 33):
            yield GPipe(p, m)
            yield OneFOneB(p, m)
            if p >= 2 and m % p == 0:
                for v in range(2, 5):
                    yield Interleaved1F1B(p, m, v)


CONFIGS = list(_configs())


def _check_counts(schedule) -> None:
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    for s in range(p):
        steps = list(schedule.steps(s))
        kinds = Counter((type(i), getattr(i, "mb", None), getattr(i, "chunk", None)) for i in steps)
        for mb in range(m):
            for c in range(v):
                first, last = schedule.is_first(s, c), schedule.is_last(s, c)
                assert kinds[(Forward, mb, c)] == 1, (schedule, s, mb, c)
                assert kinds[(Backward, mb, c)] == 1, (schedule, s, mb, c)
                assert kinds[(RecvActivation, mb, c)] == (not first)
                assert kinds[(SendGrad, mb, c)] == (not first)
                assert kinds[(SendActivation, mb, c)] == (not last)
                assert kinds[(RecvGrad, mb, c)] == (not last)
                assert kinds[(LoadMicrobatch, mb, c)] == (first or last)
        # Each backward after its forward; the step ends with the tied reduction then the optimizer.
        seen = set()
        for ins in steps:
            if isinstance(ins, Forward):
                seen.add((ins.mb, ins.chunk))
            elif isinstance(ins, Backward):
                assert (ins.mb, ins.chunk) in seen
        assert steps[-2:] == [ReduceTiedGrads(), OptimizerStep()]


def test_every_schedule_pairs_counts_terminates_and_keeps_its_memory_promise() -> None:
    for schedule in CONFIGS:
        _check_counts(schedule)
        result = simulate(schedule)  # raises on deadlock, mismatched or unmatched messages
        p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
        assert result.messages == 2 * m * (p * v - 1), schedule
        for s in range(p):
            assert result.peak_in_flight[s] == schedule.max_in_flight(s), (schedule, s)
            if isinstance(schedule, OneFOneB):
                assert result.peak_in_flight[s] <= p - s
            if isinstance(schedule, GPipe):
                assert result.peak_in_flight[s] == m
    assert len(CONFIGS) > 600


@pytest.mark.parametrize("cls", [GPipe, OneFOneB])
def test_bubble_matches_theory(cls) -> None:
    # With forward 1 and backward 2 and free messages, both flush schedules take
    # (m + p - 1)(f + b) and every stage idles (p - 1)/(m + p - 1) of it (GPipe paper, section 2.3).
    for p in range(1, 9):
        for m in range(1, 33):
            r = simulate(cls(p, m))
            assert r.makespan == 3 * (m + p - 1)
            for idle in r.idle_fraction:
                assert idle == pytest.approx((p - 1) / (m + p - 1))


def test_interleaving_shrinks_the_bubble_by_the_chunk_count() -> None:
    # Megatron (Narayanan et al. 2021, section 2.2): the bubble falls from (p-1)/m
    # to (p-1)/(v m) of the ideal time.
    for p in (2, 4, 8):
        for v in (2, 3, 4):
            m = 2 * p
            r = simulate(Interleaved1F1B(p, m, v))
            ideal = (
                3 * m
            )  # per stage: m microbatches through v chunks of 1/v the cost each (units scaled)
            assert r.makespan / v == pytest.approx(ideal + 3 * (p - 1) / v)


def test_interleaving_validates_microbatches_with_a_clear_error() -> None:
    with pytest.raises(
        ScheduleError, match=r"microbatches \(6\) must be a multiple of stages \(4\).*try 8"
    ):
        Interleaved1F1B(4, 6, 2)
    with pytest.raises(ScheduleError, match="at least 2 stages"):
        Interleaved1F1B(1, 4, 2)
    with pytest.raises(ScheduleError, match="interleaved"):
        OneFOneB(2, 4, chunks=2)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        make_schedule("zb", 2, 4)
    with pytest.raises(ScheduleError, match="stage 5 out of range"):
        list(OneFOneB(2, 4).steps(5))


def test_simulator_catches_a_deadlocking_and_a_mismatched_schedule() -> None:
    class RecvFirst(OneFOneB):  # every stage waits for a gradient before sending anything
        def _steps(self, stage):
            yield from self.recv_grad(stage, 0, 0)
            yield from super()._steps(stage)

    with pytest.raises(Deadlock, match="stage 0 at"):
        simulate(RecvFirst(3, 4))

    class Reversed(GPipe):  # the last stage receives activations in the wrong order
        def _steps(self, stage):
            steps = list(super()._steps(stage))
            if stage == self.stages - 1:
                recvs = [i for i in steps if isinstance(i, RecvActivation)][::-1]
                steps = [recvs.pop(0) if isinstance(i, RecvActivation) else i for i in steps]
            yield from steps

    with pytest.raises(SimulationError, match="meets"):
        simulate(Reversed(2, 3))


def test_timeline_draws_the_1f1b_bubble() -> None:
    text = render_timeline(OneFOneB(2, 3))
    lines = text.splitlines()
    assert lines[0].startswith("OneFOneB(stages=2, microbatches=3): makespan 12")
    assert lines[1] == "stage 0 | F0 F1 .. .. B0 b0 F2 B1 b1 .. B2 b2 | idle 25%"
    assert lines[2] == "stage 1 | .. F0 B0 b0 F1 B1 b1 F2 B2 b2 .. .. | idle 25%"
