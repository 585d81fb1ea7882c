"""A discrete-event simulation of a schedule: deadlock check, pairing, timing, memory.

The model is the executor's (`executor.py`): compute instructions take a
cost (forward 1, backward 2 by default, the usual ratio); every run of
consecutive send/recv instructions is posted as one batch; a batch that
receives anything blocks until every operation in it is matched, a batch of
sends only does not block. Operations on a directed channel (stage a -> b)
match first-in first-out, as point-to-point messages without tags do, and a
matched pair must agree on what it carries (payload kind, microbatch and
virtual stage), or the simulation raises. A state where no stage can move
is a deadlock, reported with every stage's blocked instruction.

Example::

    from capstan.pipeline import OneFOneB, simulate
    result = simulate(OneFOneB(stages=4, microbatches=8))
    print(result.makespan, result.idle_fraction)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .instructions import Backward, CommInstruction, Forward, Instruction
from .schedules import Schedule

__all__ = ["SimulationError", "Deadlock", "SimResult", "simulate", "batches", "default_cost"]


class SimulationError(AssertionError):
    """The schedule is inconsistent: mismatched messages, or an unmatched operation at the end."""


class Deadlock(SimulationError):
    """No stage can make progress while some have instructions left."""


def default_cost(instr: Instruction) -> float:
    """Forward 1, backward 2 (recomputing nothing); everything else is free."""
    if isinstance(instr, Forward):
        return 1.0
    if isinstance(instr, Backward):
        return 2.0
    return 0.0


def batches(instrs: list[Instruction]) -> list[Instruction | list[CommInstruction]]:
    """Group maximal runs of consecutive send/recv instructions (each posted at once)."""
    out: list[Instruction | list[CommInstruction]] = []
    for ins in instrs:
        if isinstance(ins, CommInstruction):
            if out and isinstance(out[-1], list):
                out[-1].append(ins)
            else:
                out.append([ins])
        else:
            out.append(ins)
    return out


@dataclass
class SimResult:
    makespan: float
    # per stage: (start, end, instruction) of every instruction that costs time
    busy: list[list[tuple[float, float, Instruction]]]
    # per stage: peak number of (mb, chunk) forwarded and not yet backwarded
    peak_in_flight: list[int]
    messages: int = 0
    idle: list[float] = field(default_factory=list)

    @property
    def idle_fraction(self) -> list[float]:
        """Per stage: the share of the makespan spent not computing (the pipeline bubble)."""
        return [
            1.0 - sum(e - s for s, e, _ in b) / self.makespan if self.makespan else 0.0
            for b in self.busy
        ]


@dataclass
class _Op:
    stage: int
    ins: CommInstruction
    posted: float
    peer: int
    matched: float | None = None

    def what(self, schedule: Schedule) -> tuple[str, int, int]:
        """(payload, microbatch, virtual stage of the activation's producer): equal at both ends."""
        vs = schedule.virtual_stage(self.stage, self.ins.chunk)
        sender_side = (self.ins.payload == "act") == (self.ins.direction == "send")
        # The activation of a boundary is produced by the lower virtual stage of the pair.
        producer = vs if sender_side else vs - 1
        return self.ins.payload, self.ins.mb, producer


def _peer(schedule: Schedule, stage: int, ins: CommInstruction) -> int:
    downstream = (ins.payload == "act") == (ins.direction == "send")
    return schedule.next_stage(stage) if downstream else schedule.prev_stage(stage)


def simulate(schedule: Schedule, cost: Callable[[Instruction], float] = default_cost,
             stage_cost: Callable[[int, Instruction], float] | None = None) -> SimResult:
    """Run every stage's instructions against each other; raise on deadlock or mismatch.

    stage_cost(stage, instruction), where given, replaces `cost` (stages that differ: capstan plan)."""
    p = schedule.stages
    programs = [batches(list(schedule.steps(s))) for s in range(p)]
    pc = [0] * p
    clock = [0.0] * p
    posted: list[list[_Op] | None] = [None] * p  # the batch a stage has posted and waits on
    sends: dict[tuple[int, int], list[_Op]] = {}
    recvs: dict[tuple[int, int], list[_Op]] = {}
    busy: list[list[tuple[float, float, Instruction]]] = [[] for _ in range(p)]
    live: list[set[tuple[int, int]]] = [set() for _ in range(p)]
    peak = [0] * p
    messages = 0

    matched_upto: dict[tuple[int, int], int] = {}  # per channel: pairs before this index are matched

    def match(channel: tuple[int, int]) -> None:
        """Pair the channel's sends and receives in order from the first unmatched pair (walking every
        message each time made the planner's simulations of 1-2k micro-batches quadratic)."""
        nonlocal messages
        ss, rs = sends.get(channel, []), recvs.get(channel, [])
        i = matched_upto.get(channel, 0)
        while i < len(ss) and i < len(rs):
            a, b = ss[i], rs[i]
            if a.what(schedule) != b.what(schedule):
                raise SimulationError(
                    f"{schedule!r}: on channel stage {channel[0]} -> {channel[1]}, "
                    f"stage {a.stage}'s {a.ins} "
                    f"meets stage {b.stage}'s {b.ins}"
                )
            a.matched = b.matched = max(a.posted, b.posted)
            messages += 1
            i += 1
        matched_upto[channel] = i

    def step(s: int) -> bool:
        item = programs[s][pc[s]]
        if isinstance(item, list):
            if posted[s] is None:
                ops = [_Op(s, ins, clock[s], _peer(schedule, s, ins)) for ins in item]
                for op in ops:
                    if op.ins.direction == "send":
                        channel = (s, op.peer)
                        sends.setdefault(channel, []).append(op)
                    else:
                        channel = (op.peer, s)
                        recvs.setdefault(channel, []).append(op)
                    match(channel)
                posted[s] = ops
                if all(op.ins.direction == "send" for op in ops):
                    posted[s], pc[s] = None, pc[s] + 1  # sends alone never block the stage
                return True
            ops = posted[s]
            if any(op.matched is None for op in ops):
                return False
            clock[s] = max([clock[s]] + [op.matched for op in ops])  # type: ignore[misc]
            posted[s], pc[s] = None, pc[s] + 1
            return True
        c = stage_cost(s, item) if stage_cost is not None else cost(item)
        if c:
            busy[s].append((clock[s], clock[s] + c, item))
            clock[s] += c
        if isinstance(item, Forward):
            live[s].add((item.mb, item.chunk))
            peak[s] = max(peak[s], len(live[s]))
        elif isinstance(item, Backward):
            live[s].discard((item.mb, item.chunk))
        pc[s] += 1
        return True

    while True:
        moved = False
        for s in range(p):
            while pc[s] < len(programs[s]) and step(s):
                moved = True
        if all(pc[s] == len(programs[s]) for s in range(p)):
            break
        if not moved:
            blocked = [
                f"stage {s} at {[str(i) for i in programs[s][pc[s]]]}"
                for s in range(p)
                if pc[s] < len(programs[s])
            ]
            raise Deadlock(f"{schedule!r} deadlocks: " + "; ".join(blocked))
    unmatched = [op for q in (*sends.values(), *recvs.values()) for op in q if op.matched is None]
    if unmatched:
        raise SimulationError(
            f"{schedule!r}: unmatched {[(o.stage, str(o.ins)) for o in unmatched[:4]]}"
        )
    # Sends complete when matched; a stage is done once its last send has been taken.
    finish = max(clock + [op.matched for q in sends.values() for op in q if op.matched is not None])
    return SimResult(makespan=finish, busy=busy, peak_in_flight=peak, messages=messages)
