"""A dead or silent peer becomes a CommError within the timeout, never a hang."""

from __future__ import annotations

import os
import signal
import time

import torch

from capstan.comm.testing import run_ranks

COMM_TIMEOUT = 5.0


def _survive_a_killed_rank(victim: int) -> tuple[str, str, float, list[int]] | None:
    from capstan import comm

    w = comm.world()
    comm.barrier()  # everyone is connected before the victim dies
    if w.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1000))
    except comm.CommError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start, exc.lost
    return None


def test_killed_rank_becomes_comm_error_naming_it() -> None:
    results = run_ranks(_survive_a_killed_rank, 3, 1, comm_timeout=COMM_TIMEOUT, tolerate_dead=(1,), timeout=90)
    assert results[1] is None
    for r in (0, 2):
        name, message, elapsed, lost = results[r]
        assert name == "CommError"
        assert lost == [1], message
        assert "all_reduce on group world[0, 1, 2] failed" in message and "lost rank(s) [1]" in message
        # The timeout plus the heartbeat staleness window bounds the wait.
        assert elapsed < COMM_TIMEOUT + 5.0, elapsed


def _silent_peer() -> tuple[str, float, list[int]] | str:
    from capstan import comm

    if comm.world().rank == 1:
        time.sleep(COMM_TIMEOUT + 6.0)  # alive but never joins: a hang, not a death
        return "slept"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
    except comm.CommError as exc:
        return str(exc), time.monotonic() - start, exc.lost
    return "no error"


def test_silent_peer_times_out_with_comm_error() -> None:
    results = run_ranks(_silent_peer, 2, comm_timeout=COMM_TIMEOUT, timeout=90)
    message, elapsed, lost = results[0]
    assert "all_reduce on group world[0, 1] failed" in message
    assert lost == []  # rank 1 is alive: nobody is blamed
    assert COMM_TIMEOUT - 0.5 <= elapsed < COMM_TIMEOUT + 6.0, elapsed
    assert results[1] == "slept"


def _recv_from_dead_peer() -> tuple[str, list[int]] | None:
    from capstan import comm

    comm.barrier()
    if comm.world().rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.recv(torch.empty(3), src=0)
    except comm.CommError as exc:
        return str(exc), exc.lost
    return None


def test_recv_from_a_dead_peer_names_it() -> None:
    results = run_ranks(_recv_from_dead_peer, 2, comm_timeout=COMM_TIMEOUT, tolerate_dead=(0,), timeout=90)
    message, lost = results[1]
    assert lost == [0] and "recv from rank 0" in message
