"""The explicit state machines of the chunk system (PatrickStar's `core/const.py`, checked).

A parameter (`TensorState`) moves FREE -> COMPUTE when a module is about to
use it, and to HOLD_AFTER_FWD / HOLD_AFTER_BWD when the module is done. A
chunk's state is derived from its tensors': COMPUTE if any tensor is in
use (the chunk must then sit in the compute tier and cannot move), FREE if
all are free (its memory may be dropped), HOLD otherwise (resident data that
may be moved to a lower tier).
"""

from __future__ import annotations

import enum

__all__ = ["TensorState", "ChunkState", "ChunkKind", "StateError", "check_transition", "chunk_state_of"]


class StateError(RuntimeError):
    """A transition the state machine does not allow (a bookkeeping bug, never user input)."""


class TensorState(enum.Enum):
    FREE = "free"  # no payload needed (e.g. a gradient slot before backward)
    COMPUTE = "compute"  # a module is using it right now
    HOLD = "hold"  # payload valid, nobody using it
    HOLD_AFTER_FWD = "hold_after_fwd"  # used in this forward; needed again in backward
    HOLD_AFTER_BWD = "hold_after_bwd"  # its backward use is over for this step


class ChunkState(enum.Enum):
    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"


class ChunkKind(enum.Enum):
    """What a chunk list stores. Sibling chunks of one parameter group share offsets."""

    PARAM = "param"  # the tensors modules compute with (16-bit, or fp32 in pure-fp32 mode)
    MASTER = "master"  # fp32 master copy (mixed precision only)
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    GRAD = "grad"  # separate gradient chunks (fp32 mode, or gradient accumulation)
    # 1-bit Adam's error-feedback residuals (replicated.py): per-rank state of no tensor, sized by the list
    ONEBIT_WORKER = "onebit_worker"
    ONEBIT_SERVER = "onebit_server"


_ALLOWED: dict[TensorState, set[TensorState]] = {
    TensorState.FREE: {TensorState.COMPUTE, TensorState.HOLD},
    TensorState.HOLD: {TensorState.COMPUTE, TensorState.FREE, TensorState.HOLD},
    TensorState.COMPUTE: {
        TensorState.COMPUTE,  # a shared parameter used again while in use (counted by the caller)
        TensorState.HOLD,
        TensorState.HOLD_AFTER_FWD,
        TensorState.HOLD_AFTER_BWD,
    },
    TensorState.HOLD_AFTER_FWD: {TensorState.COMPUTE, TensorState.HOLD, TensorState.HOLD_AFTER_FWD},
    TensorState.HOLD_AFTER_BWD: {TensorState.COMPUTE, TensorState.HOLD, TensorState.HOLD_AFTER_BWD},
}


def check_transition(old: TensorState, new: TensorState, what: str) -> None:
    """Raise StateError unless old -> new is a legal tensor transition."""
    if new not in _ALLOWED[old]:
        raise StateError(f"{what}: illegal tensor state transition {old.value} -> {new.value}")


def chunk_state_of(states: list[TensorState]) -> ChunkState:
    """Derive a chunk's state from its tensors' states."""
    if any(s is TensorState.COMPUTE for s in states):
        return ChunkState.COMPUTE
    if all(s is TensorState.FREE for s in states):
        return ChunkState.FREE
    return ChunkState.HOLD
