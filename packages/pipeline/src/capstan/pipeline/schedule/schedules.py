"""Pipeline schedules as pure data: one instruction generator per stage.

Three schedules, each a small class whose `steps(stage)` yields the
instructions (see `instructions.py`) that stage runs for one training step:

- `GPipe` (Huang et al. 2019): all forwards, then all backwards. Every stage
  holds the activations of all `microbatches` at the peak.
- `OneFOneB` (PipeDream-Flush, Narayanan et al. 2021, Fig. 4 top): a warm-up of
  `stages - stage - 1` forwards, then one forward / one backward alternately,
  then the remaining backwards. Same bubble as GPipe, (p-1)/(m+p-1) of the
  step, but at most `stages - stage` microbatches in flight.
- `Interleaved1F1B` (Narayanan et al. 2021, Fig. 4 bottom): each stage holds
  `chunks` model chunks (virtual stages); the bubble shrinks by that factor.
  Like Megatron-LM it needs `microbatches` to be a multiple of `stages`.

The order of the communication instructions matters, not just their set:
the executor posts every run of consecutive send/recv instructions as one
batch (`comm.exchange`) and waits for a batch that receives anything. The
orders below follow Megatron-LM's `schedules.py` (send_forward_recv_backward
and friends), so each batch meets a matching batch on the neighbour; the
simulator (`simulate.py`) checks this for every configuration in the tests.

Example::

    from capstan.pipeline import OneFOneB, render_timeline
    print(render_timeline(OneFOneB(stages=4, microbatches=8)))
"""

from __future__ import annotations

from collections.abc import Iterator

from .instructions import (
    Backward,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)

__all__ = [
    "Schedule",
    "GPipe",
    "OneFOneB",
    "Interleaved1F1B",
    "ScheduleError",
    "SCHEDULES",
    "make_schedule",
]


class ScheduleError(ValueError):
    """A schedule was asked for a configuration it cannot run."""


class Schedule:
    """Common geometry: stages, microbatches, chunks (virtual stages per stage)."""

    name = "schedule"

    def __init__(self, stages: int, microbatches: int, chunks: int = 1) -> None:
        for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(
                    f"{self.name}: {what} must be a positive integer, got {value!r}"
                )
        self.stages, self.microbatches, self.chunks = stages, microbatches, chunks

    def __repr__(self) -> str:
        extra = f", chunks={self.chunks}" if self.chunks > 1 else ""
        return (
            f"{type(self).__name__}(stages={self.stages}, microbatches={self.microbatches}{extra})"
        )

    # ---- virtual-stage geometry (chunk c of stage s is virtual stage c * stages + s)
    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def is_first(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == self.virtual_stages - 1

    def next_stage(self, stage: int) -> int:
        """The stage that consumes this stage's activations (wrapping round for interleaving)."""
        return (stage + 1) % self.stages

    def prev_stage(self, stage: int) -> int:
        return (stage - 1) % self.stages

    def loads_data(self, stage: int, chunk: int) -> bool:
        """Whether the forward of (stage, chunk) needs inputs or targets from the data."""
        return self.is_first(stage, chunk) or self.is_last(stage, chunk)

    # ---- building blocks shared by the schedules
    def recv_act(self, stage: int, mb: int, chunk: int) -> list[Instruction]:
        return [] if self.is_first(stage, chunk) else [RecvActivation(mb, chunk)]

    def send_act(self, stage: int, mb: int, chunk: int) -> list[Instruction]:
        return [] if self.is_last(stage, chunk) else [SendActivation(mb, chunk)]

    def recv_grad(self, stage: int, mb: int, chunk: int) -> list[Instruction]:
        return [] if self.is_last(stage, chunk) else [RecvGrad(mb, chunk)]

    def send_grad(self, stage: int, mb: int, chunk: int) -> list[Instruction]:
        return [] if self.is_first(stage, chunk) else [SendGrad(mb, chunk)]

    def forward(self, stage: int, mb: int, chunk: int) -> list[Instruction]:
        load = [LoadMicrobatch(mb, chunk)] if self.loads_data(stage, chunk) else []
        return load + [Forward(mb, chunk)]

    def check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.stages:
            raise ScheduleError(f"{self!r}: stage {stage} out of range 0..{self.stages - 1}")

    def steps(self, stage: int) -> Iterator[Instruction]:
        """Instructions of one training step on `stage`."""
        self.check_stage(stage)
        yield from self._steps(stage)
        yield ReduceTiedGrads()
        yield OptimizerStep()

    def _steps(self, stage: int) -> Iterator[Instruction]:  # pragma: no cover - interface
        raise NotImplementedError

    def max_in_flight(self, stage: int) -> int:
        """The promised peak of (microbatch, chunk) pairs forwarded but not yet backwarded."""
        raise NotImplementedError  # pragma: no cover - interface


class GPipe(Schedule):
    """All forwards, then all backwards (in the same microbatch order on every stage)."""

    name = "gpipe"

    def __init__(self, stages: int, microbatches: int, chunks: int = 1) -> None:
        super().__init__(stages, microbatches, chunks)
        if chunks != 1:
            raise ScheduleError("gpipe: chunks (virtual stages) need the interleaved 1F1B schedule")

    def _steps(self, stage: int) -> Iterator[Instruction]:
        for mb in range(self.microbatches):
            yield from self.recv_act(stage, mb, 0)
            yield from self.forward(stage, mb, 0)
            yield from self.send_act(stage, mb, 0)
        for mb in range(self.microbatches):
            yield from self.recv_grad(stage, mb, 0)
            yield Backward(mb, 0)
            yield from self.send_grad(stage, mb, 0)

    def max_in_flight(self, stage: int) -> int:
        return self.microbatches


class OneFOneB(Schedule):
    """PipeDream-Flush: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""

    name = "1f1b"

    def __init__(self, stages: int, microbatches: int, chunks: int = 1) -> None:
        super().__init__(stages, microbatches, chunks)
        if chunks != 1:
            raise ScheduleError("1f1b: chunks (virtual stages) need the interleaved 1F1B schedule")

    def _steps(self, stage: int) -> Iterator[Instruction]:
        m = self.microbatches
        warmup = min(self.stages - stage - 1, m)
        remaining = m - warmup
        for mb in range(warmup):
            yield from self.recv_act(stage, mb, 0)
            yield from self.forward(stage, mb, 0)
            yield from self.send_act(stage, mb, 0)
        if remaining:
            yield from self.recv_act(stage, warmup, 0)
        for i in range(remaining):
            fwd = warmup + i
            yield from self.forward(stage, fwd, 0)
            # send_forward_recv_backward: one batch, met by the next stage's
            # send_backward_recv_forward.
            yield from self.send_act(stage, fwd, 0)
            yield from self.recv_grad(stage, i, 0)
            yield Backward(i, 0)
            yield from self.send_grad(stage, i, 0)
            if i < remaining - 1:
                yield from self.recv_act(stage, fwd + 1, 0)
        for mb in range(remaining, m):
            yield from self.recv_grad(stage, mb, 0)
            yield Backward(mb, 0)
            yield from self.send_grad(stage, mb, 0)

    def max_in_flight(self, stage: int) -> int:
        return min(self.stages - stage, self.microbatches)


class Interleaved1F1B(Schedule):
    """Megatron-LM's interleaved 1F1B over `chunks` model chunks per stage."""

    name = "interleaved-1f1b"

    def __init__(self, stages: int, microbatches: int, chunks: int = 2) -> None:
        super().__init__(stages, microbatches, chunks)
        if stages < 2:
            raise ScheduleError(
                "interleaved-1f1b: needs at least 2 stages (with one, chunks gain nothing)"
            )
        if microbatches % stages:
            raise ScheduleError(
                f"interleaved-1f1b: microbatches ({microbatches}) must be a multiple of "
                f"stages ({stages}); "
                f"microbatches advance through the chunks in groups of one per stage "
                f"(try {microbatches + stages - microbatches % stages})"
            )

    # Megatron's order: the k-th forward takes microbatch group k // (p*v), chunk (k // p) % v.
    def _fwd(self, k: int) -> tuple[int, int]:
        p, v = self.stages, self.chunks
        group, within = divmod(k, p * v)
        return group * p + within % p, within // p

    def _bwd(self, k: int) -> tuple[int, int]:
        mb, chunk = self._fwd(k)
        return mb, self.chunks - 1 - chunk

    def warmup(self, stage: int) -> int:
        total = self.microbatches * self.chunks
        if self.microbatches == self.stages:
            return total  # Megatron: with m == p every forward precedes every backward
        return min((self.stages - stage - 1) * 2 + (self.chunks - 1) * self.stages, total)

    def _steps(self, stage: int) -> Iterator[Instruction]:
        total = self.microbatches * self.chunks
        warmup = self.warmup(stage)
        remaining = total - warmup
        yield from self.recv_act(stage, *self._fwd(0))
        for k in range(warmup):
            mb, chunk = self._fwd(k)
            yield from self.forward(stage, mb, chunk)
            # One batch: send this output, receive the next forward's input and, at the
            # end of the warm-up, the first backward's output gradient.
            yield from self.send_act(stage, mb, chunk)
            if k + 1 < total:
                yield from self.recv_act(stage, *self._fwd(k + 1))
            if k == warmup - 1 and remaining:
                yield from self.recv_grad(stage, *self._bwd(0))
        for i in range(remaining):
            fmb, fchunk = self._fwd(warmup + i)
            bmb, bchunk = self._bwd(i)
            yield from self.forward(stage, fmb, fchunk)
            yield Backward(bmb, bchunk)
            # One batch with both neighbours: send output and input-grad, receive the next of each.
            yield from self.send_act(stage, fmb, fchunk)
            yield from self.send_grad(stage, bmb, bchunk)
            if warmup + i + 1 < total:
                yield from self.recv_act(stage, *self._fwd(warmup + i + 1))
            if i + 1 < total:
                yield from self.recv_grad(stage, *self._bwd(i + 1))
        if not remaining:
            yield from self.recv_grad(stage, *self._bwd(0))
        for k in range(remaining, total):
            mb, chunk = self._bwd(k)
            yield Backward(mb, chunk)
            yield from self.send_grad(stage, mb, chunk)
            if k + 1 < total:
                yield from self.recv_grad(stage, *self._bwd(k + 1))

    def max_in_flight(self, stage: int) -> int:
        return min(self.warmup(stage) + 1, self.microbatches * self.chunks)


SCHEDULES: dict[str, type[Schedule]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved-1f1b": Interleaved1F1B,
}


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """A schedule by name ('gpipe', '1f1b', 'interleaved-1f1b')."""
    try:
        cls = SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}"
        ) from None
    return cls(stages, microbatches, chunks)
