"""Stopping a training job on SIGTERM / SIGHUP: every rank at the same step boundary, each with exit 143.

A scheduler (SLURM, Kubernetes, systemd) or `capstan launch` stops a job with SIGTERM, and mpirun
passes it to every rank. Raising at once wherever the signal lands is not clean on several ranks:
one rank may be computing while its peer waits in a collective for it, so the first one leaves,
the second waits in C code (where Python cannot run its handler) for a peer that is gone, and is
killed by mpirun's escalation with no exit status ("died without an exit status", as if it had
crashed). So inside the training loop (`at_step_boundaries`) the handler only notes the signal,
and at the end of each step the ranks agree (one all-reduce of an int) and all raise `Stopped`
together: every rank exits 128 + signal, and a checkpoint due at that step is complete first.

A step that does not end within `DEFER_S` of the signal (a long step, or one stuck in a
collective) is not waited for: the rank stops where it is, as outside the loop. The wait is short
because mpirun escalates to SIGKILL about a second after it forwards a SIGTERM. A repeated stop
signal is ignored while the rank unwinds (mpirun repeats the stop to every rank still there once
one has exited). The exit status is recorded when the signal arrives, so a rank that mpirun or
`capstan launch` kills while it unwinds, or while it waits in a collective for a peer that has
already stopped, is reported as stopped, not as crashed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["Stopped", "stop_on_signals", "at_step_boundaries", "agree_to_stop", "DEFER_S"]

DEFER_S = 0.5  # how long a stop waits for the step boundary (mpirun kills about 1 s after SIGTERM)
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """SIGTERM or SIGHUP reached a training rank: a scheduler or `capstan launch` is stopping the
    job. A BaseException, like KeyboardInterrupt, so no `except Exception` on the way out swallows
    it; the run's `finally` blocks still close files."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class _State:
    pending: int = 0  # the stop signal received and not yet acted on
    deferring: bool = False  # inside the training loop: act at the step boundary


_state = _State()


def _record(signum: int) -> None:
    from .mpirun import rank_finished

    rank_finished(128 + signum)  # for `capstan launch`; rewritten with the final code on the way out


def _stop_now(signum: int) -> None:
    for s in _SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 0)
    _record(signum)
    raise Stopped(signum)


def _on_signal(signum: int, frame: object) -> None:
    if _state.deferring and not _state.pending:
        _state.pending = signum
        _record(signum)
        signal.setitimer(signal.ITIMER_REAL, DEFER_S)  # SIGALRM: the step did not end in time
        return
    _stop_now(_state.pending or signum)


def _on_alarm(signum: int, frame: object) -> None:
    if _state.pending:
        _stop_now(_state.pending)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside: SIGTERM and SIGHUP stop this rank (`Stopped`, exit 128 + signal), at once outside
    `at_step_boundaries`. The previous handlers come back on the way out (tests call `main`
    in-process); off the main thread (which alone gets signals) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (*_SIGNALS, signal.SIGALRM)
    before = {s: signal.getsignal(s) for s in sigs}
    for s in _SIGNALS:
        signal.signal(s, _on_signal)
    signal.signal(signal.SIGALRM, _on_alarm)
    _state.pending, _state.deferring = 0, False
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in before.items():
            signal.signal(s, handler)
        _state.pending, _state.deferring = 0, False


@contextlib.contextmanager
def at_step_boundaries() -> Iterator[None]:
    """Inside: a stop signal waits (up to DEFER_S) for `agree_to_stop` at the end of a step."""
    if signal.getsignal(signal.SIGTERM) is not _on_signal:  # no stop_on_signals around (the Python API)
        yield
        return
    _state.deferring = True
    try:
        yield
    finally:
        _state.deferring = False
        if _state.pending:  # the loop ended (or failed) with a stop noted: act on it now
            _stop_now(_state.pending)


def agree_to_stop(group: object) -> None:
    """At a step boundary (every rank of `group` calls it): raise `Stopped` on every rank if any
    rank has received a stop signal. One all-reduce of one int; nothing without a stop handler."""
    if signal.getsignal(signal.SIGTERM) is not _on_signal:
        return
    import torch

    from capstan import comm

    flag = torch.tensor([_state.pending], dtype=torch.int64)
    if getattr(group, "size", 1) > 1:
        comm.all_reduce(flag, op="max", group=group)
    signum = int(flag.item())
    if signum:
        _stop_now(signum)
