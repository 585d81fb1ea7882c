"""Pipeline instructions: the vocabulary a schedule speaks and an executor obeys.

A schedule is pure data: per stage, a sequence of these frozen objects. The
executor (`executor.py`) runs them through a table of handlers; the simulator
(`simulate.py`) runs them against a cost model. Neither the schedule nor these
objects know anything about tensors or process groups.

`mb` is the microbatch index, `chunk` the model chunk held by this stage
(always 0 without interleaving; with v virtual stages per rank, stage s holds
chunks 0..v-1, chunk c being virtual stage c * stages + s, as in Megatron's
interleaved schedule, Narayanan et al. 2021, section 2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Instruction",
    "LoadMicrobatch",
    "Forward",
    "Backward",
    "SendActivation",
    "RecvActivation",
    "SendGrad",
    "RecvGrad",
    "ReduceTiedGrads",
    "OptimizerStep",
    "CommInstruction",
    "ComputeInstruction",
]


@dataclass(frozen=True)
class Instruction:
    """Base of every instruction; `str()` is the short form used in errors and timelines."""

    def __str__(self) -> str:
        fields = ", ".join(
            f"{k}={v}" for k, v in self.__dict__.items() if k not in ("direction", "payload")
        )
        return f"{type(self).__name__}({fields})"


@dataclass(frozen=True)
class ComputeInstruction(Instruction):
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class CommInstruction(Instruction):
    """A point-to-point half. Consecutive ones are posted together as one batch."""

    mb: int
    chunk: int = 0

    # "send" or "recv"; and what travels: the activation (forward) or its gradient.
    direction: str = ""
    payload: str = ""


@dataclass(frozen=True)
class LoadMicrobatch(ComputeInstruction):
    """Take microbatch `mb`'s inputs (first virtual stage) and/or targets (last virtual stage)."""


@dataclass(frozen=True)
class Forward(ComputeInstruction):
    """Run chunk `chunk` forward on microbatch `mb` (the loss too on the last virtual stage)."""


@dataclass(frozen=True)
class Backward(ComputeInstruction):
    """Back-propagate microbatch `mb` through chunk `chunk`, accumulating parameter gradients."""


@dataclass(frozen=True)
class SendActivation(CommInstruction):
    """Send the output of (mb, chunk) to the next virtual stage."""

    direction: str = "send"
    payload: str = "act"


@dataclass(frozen=True)
class RecvActivation(CommInstruction):
    """Receive the input of (mb, chunk) from the previous virtual stage."""

    direction: str = "recv"
    payload: str = "act"


@dataclass(frozen=True)
class SendGrad(CommInstruction):
    """Send the gradient of (mb, chunk)'s input to the previous virtual stage."""

    direction: str = "send"
    payload: str = "grad"


@dataclass(frozen=True)
class RecvGrad(CommInstruction):
    """Receive the gradient of (mb, chunk)'s output from the next virtual stage."""

    direction: str = "recv"
    payload: str = "grad"


@dataclass(frozen=True)
class ReduceTiedGrads(Instruction):
    """Sum the gradients of weights shared between stages (tied embedding / LM head)."""


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    """Apply the optimizer (when the executor has one) after all microbatches."""
