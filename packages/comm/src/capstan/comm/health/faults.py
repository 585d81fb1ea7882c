"""Fault injection at named points, for the crash-safety and fault tests (integration_tests/test_faults.py).

``CAPSTAN_CRASH_AT="save.shard_written:step=4:rank=1"`` makes rank 1 kill
itself with SIGKILL (no cleanup, no atexit: what a power cut or the OOM killer
does) when it reaches `save.shard_written` at step 4. Conditions are
``key=value`` pairs compared with the keywords of `crash_point` (``rank`` is
the world rank when the caller gives none); without the variable every call
is a no-op costing one dictionary lookup. Reserved keys:

* ``after=N``: act at the N-th call that meets the other conditions (1 = the first);
* ``action=kill`` (default, SIGKILL), ``action=term`` (SIGTERM to this process,
  as a scheduler stopping the job would send), ``action=pause`` (sleep
  ``seconds=S``, default 30: a window for the test to signal the process);
* ``once=PATH``: act only if PATH does not exist, and create it first, so a
  job relaunched after the crash (``capstan launch --max-restarts``) runs on.

Points: ``save.shard_written`` (a rank's shard is on disk, the manifest is
not), ``save.before_rename`` (rank 0 wrote the manifest, the directory still
has its temporary name), ``train.step`` (a step finished, ``step`` = its
number), ``forward``, ``backward`` (inside autograd, at the loss's gradient),
``optimizer.step``, ``pipeline.transfer`` (a stage about to post its
sends/receives), ``zero3.gather`` (a ZeRO-3 unit about to be all-gathered).

``CAPSTAN_FILE_SIZE_LIMIT="BYTES[:rank=R]"`` (`limit_file_size`, called at a
rank's start) makes the kernel refuse to grow any file this process writes
past BYTES (RLIMIT_FSIZE, EFBIG), exactly where a full disk refuses with
ENOSPC: a full disk on one rank, or on all, without filling one.
"""

from __future__ import annotations

import os
import signal
import time

from ..job.launch_env import env_rank

__all__ = ["crash_point", "armed", "limit_file_size", "ENV", "FSIZE_ENV"]

ENV = "CAPSTAN_CRASH_AT"
FSIZE_ENV = "CAPSTAN_FILE_SIZE_LIMIT"
_RESERVED = ("after", "action", "seconds", "once")
_calls: dict[str, int] = {}


def armed(point: str | None = None) -> bool:
    """Whether a fault is set (at `point`, when given): callers skip preparing a crash point otherwise."""
    spec = os.environ.get(ENV)
    return bool(spec) and (point is None or spec.split(":", 1)[0] == point)


def _my_rank() -> int | None:
    from ..job import state

    if state.is_initialized():
        return state.world().rank
    return env_rank()


def crash_point(point: str, **where: object) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, *conds = spec.split(":")
    if name != point:
        return
    if "rank" not in where:
        where["rank"] = _my_rank()
    opts: dict[str, str] = {}
    for cond in conds:
        key, _, value = cond.partition("=")
        if key in _RESERVED:
            opts[key] = value
        elif str(where.get(key)) != value:
            return
    _calls[spec] = _calls.get(spec, 0) + 1
    if _calls[spec] != int(opts.get("after", "1")):
        return
    once = opts.get("once")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    action = opts.get("action", "kill")
    if action == "pause":
        time.sleep(float(opts.get("seconds", "30")))
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def limit_file_size() -> None:
    """Apply ``CAPSTAN_FILE_SIZE_LIMIT`` to this process (see the module docstring)."""
    spec = os.environ.get(FSIZE_ENV)
    if not spec:
        return
    size, *conds = spec.split(":")
    for cond in conds:
        key, _, value = cond.partition("=")
        if key == "rank" and str(_my_rank()) != value:
            return
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit returns EFBIG instead
    limit = int(size)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
