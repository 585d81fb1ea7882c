"""The run directory's guards: one run at a time, and a resume that says what it found.

* `lock_run`: world rank 0 holds ``<log.run_dir>/.capstan.lock`` (and one in
  checkpoint.dir when that lies elsewhere) for the whole run
  (capstan.comm.health.lockfile: an flock the kernel drops when the process ends,
  kill -9 included). A second run on the same directory fails on every rank
  with one line naming the holder, before it writes a byte: two runs would
  splice their metrics and delete each other's ``.partial`` checkpoints.
* `check_resume`: with ``checkpoint.resume``, directories that look like
  checkpoints but have no manifest (an interrupted save, a manifest removed
  by hand) are named in one warning line; and when nothing complete is left
  while the run directory already holds an earlier run's metrics.jsonl, the
  run stops (exit 2) rather than start from step 0 over them, unless
  ``checkpoint.allow_fresh_start`` says to, which keeps the old file as
  ``metrics.jsonl.1`` (``.2`` ...). A resumed run appends to metrics.jsonl.

Both decide on world rank 0, which writes the run directory, and every rank
raises the same error (`comm.first_error`), so no rank is left waiting.
"""

from __future__ import annotations

from pathlib import Path

from capstan import comm
from capstan.comm.health.lockfile import Lock, LockHeld, hold

from ..checkpoint import CheckpointError, incomplete_checkpoints, latest
from ..config import Config

__all__ = ["RunDirError", "lock_run", "check_resume", "LOCK_NAME"]

LOCK_NAME = ".capstan.lock"
log = comm.get_logger(__name__)


class RunDirError(ValueError):
    """The run directory cannot be used by this run (another run holds it)."""


def _checkpoint_root(cfg: Config) -> Path:
    d = Path(cfg.checkpoint.dir)
    return d if d.is_absolute() else Path(cfg.log.run_dir) / d


def lock_run(cfg: Config, groups: comm.Groups) -> list[Lock]:
    """Hold the run directory (and an outside checkpoint directory) for this run; collective."""
    run_dir = Path(cfg.log.run_dir)
    locks: list[Lock] = []
    error = ""
    if groups.world.rank == 0:
        targets = [(run_dir / LOCK_NAME, f"log.run_dir {run_dir}")]
        ckpt = _checkpoint_root(cfg)
        if run_dir.resolve() not in (ckpt.resolve(), *ckpt.resolve().parents):
            targets.append((ckpt / LOCK_NAME, f"checkpoint.dir {ckpt}"))
        try:
            for path, what in targets:
                locks.append(hold(path, what))
        except (LockHeld, OSError) as exc:
            error = str(exc)
            for lock in locks:
                lock.release()
            locks = []
    first = comm.first_error(error, groups.world)
    if first:
        raise RunDirError(f"{first}; wait for it to finish, or give this run another log.run_dir")
    return locks


def check_resume(cfg: Config, groups: comm.Groups) -> None:
    """Before `checkpoint.resume` loads (see the module docstring); collective."""
    error = ""
    if groups.world.rank == 0:
        error = _resume_problem(cfg)
    first = comm.first_error(error, groups.world)
    if first:
        raise CheckpointError(first)


def _resume_problem(cfg: Config) -> str:
    root = _checkpoint_root(cfg)
    broken = incomplete_checkpoints(root)
    if broken:
        names = ", ".join(p.name for p in broken[-3:]) + (f" and {len(broken) - 3} more" if len(broken) > 3 else "")
        log.warning("checkpoint.resume: skipping %d director%s without a manifest in %s (%s): an interrupted "
                    "save, or a manifest removed", len(broken), "y" if len(broken) == 1 else "ies", root, names)
    if root.is_dir() and latest(root) is not None:
        return ""
    metrics = Path(cfg.log.run_dir) / "metrics.jsonl"
    records = _count_lines(metrics)
    if not records:
        return ""
    nothing = "no complete checkpoint" + (f" (only {len(broken)} without a manifest)" if broken else "")
    if not cfg.checkpoint.allow_fresh_start:
        return (f"checkpoint.resume: {root} holds {nothing}, but {metrics} already has {records} records of an "
                "earlier run; set checkpoint.allow_fresh_start = true to start over from step 0 (the old "
                "metrics.jsonl is then kept beside it), or checkpoint.resume = false")
    kept = _set_aside(metrics)
    log.warning("checkpoint.resume: %s holds %s; starting from step 0 (checkpoint.allow_fresh_start), the earlier "
                "run's metrics kept as %s", root, nothing, kept.name)
    return ""


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def _set_aside(path: Path) -> Path:
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    target = path.with_name(f"{path.name}.{n}")
    path.replace(target)
    return target
