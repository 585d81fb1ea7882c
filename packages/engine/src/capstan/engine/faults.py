"""Crash injection at named points, for the crash-safety tests of checkpoints.

``CAPSTAN_CRASH_AT="save.shard_written:step=4:rank=1"`` makes rank 1 kill
itself with SIGKILL (no cleanup, no atexit: what a power cut or the OOM killer
does) when it reaches `save.shard_written` at step 4. Conditions are
``key=value`` pairs compared with the keywords of `crash_point`; without the
variable every call is a no-op costing one dictionary lookup.

Points: ``save.shard_written`` (a rank's shard is on disk, the manifest is
not), ``save.before_rename`` (rank 0 wrote the manifest, the directory still
has its temporary name).
"""

from __future__ import annotations

import os
import signal

__all__ = ["crash_point", "ENV"]

ENV = "CAPSTAN_CRASH_AT"


def crash_point(point: str, **where: object) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, *conds = spec.split(":")
    if name != point:
        return
    for cond in conds:
        key, _, value = cond.partition("=")
        if str(where.get(key)) != value:
            return
    os.kill(os.getpid(), signal.SIGKILL)
