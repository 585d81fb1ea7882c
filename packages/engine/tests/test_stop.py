"""Stop signals (stop.py): inside the training loop a SIGTERM waits for the step boundary, where the
ranks agree and all stop together; a step that does not end in time is not waited for."""

from __future__ import annotations

import os
import signal
import time

import pytest

from capstan.comm.job.groups import Group
from capstan.engine.run import stop

ONE = Group("world", (0,), 0)


def test_outside_the_loop_a_stop_signal_raises_at_once() -> None:
    with stop.stop_on_signals(), pytest.raises(stop.Stopped, match="stopped by SIGTERM") as got:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs before this returns
    assert got.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back


def test_inside_the_loop_it_waits_for_the_step_boundary() -> None:
    steps = []
    with stop.stop_on_signals(), pytest.raises(stop.Stopped, match="stopped by SIGHUP"):
        with stop.at_step_boundaries():
            for step in range(5):
                if step == 1:
                    os.kill(os.getpid(), signal.SIGHUP)
                    time.sleep(0.05)  # delivered: noted, not raised
                steps.append(step)  # the rest of the step still runs
                stop.agree_to_stop(ONE)
    assert steps == [0, 1]


def test_a_step_that_does_not_end_in_time_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stop, "DEFER_S", 0.2)
    t0 = time.monotonic()
    with stop.stop_on_signals(), pytest.raises(stop.Stopped):
        with stop.at_step_boundaries():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # a long step: SIGALRM stops it after DEFER_S
    assert time.monotonic() - t0 < 2


def test_a_repeated_stop_signal_is_ignored_while_unwinding() -> None:
    unwound = False
    with stop.stop_on_signals(), pytest.raises(stop.Stopped):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # mpirun repeating the stop: must not kill the rank here
            time.sleep(0.05)
            unwound = True
    assert unwound


def test_without_a_stop_handler_nothing_is_deferred() -> None:
    """The Python API (no `capstan train` around): the loop helpers do nothing."""
    with stop.at_step_boundaries():
        stop.agree_to_stop(ONE)

