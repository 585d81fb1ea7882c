"""Checkpoints of the flat (ZeRO 0-2) state: one file per rank, a marker when all are written.

Layout: ``<dir>/step_00000040/rank_00003.pt`` per rank, then ``COMPLETE``
written by rank 0 after a barrier. Resuming takes the newest directory
with the marker, so a crash while saving never loses the previous
checkpoint; old ones are deleted only after a newer one is complete. The
data order is a function of the step (data.py), so resuming at step k
continues with exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from capstan import comm

from .engine import Engine

__all__ = ["save", "load_latest", "checkpoint_dir", "CheckpointError"]

MARKER = "COMPLETE"


class CheckpointError(ValueError):
    """A checkpoint cannot be used for this run (wrong layout, unreadable file)."""


def checkpoint_dir(engine: Engine, run_dir: Path) -> Path:
    d = Path(engine.config.checkpoint.dir)
    return d if d.is_absolute() else run_dir / d


def save(engine: Engine, root: Path) -> Path:
    """Save every rank's state for the current step; prune to checkpoint.keep complete ones."""
    rank = engine.groups.world.rank
    target = root / f"step_{engine.global_step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    state = {"optimizer": engine.optimizer.state_dict(), "step": engine.global_step,
             "scaler": engine.scaler.state_dict() if engine.scaler is not None else None}
    tmp = target / f"rank_{rank:05d}.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(target / f"rank_{rank:05d}.pt")  # atomic: a reader sees the old or the whole new file
    comm.barrier(engine.groups.world)
    if rank == 0:
        (target / MARKER).write_text(f"{engine.groups.world.size}\n")
        done = sorted(p for p in root.glob("step_*") if (p / MARKER).exists())
        for old in done[: -engine.config.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier(engine.groups.world)
    return target


def load_latest(engine: Engine, root: Path) -> int:
    """Load the newest complete checkpoint under `root`; returns its step (0 when there is none)."""
    done = sorted(p for p in root.glob("step_*") if (p / MARKER).exists())
    if not done:
        return 0
    latest = done[-1]
    world = int((latest / MARKER).read_text().strip() or 0)
    if world != engine.groups.world.size:
        raise CheckpointError(f"checkpoint {latest} was written by {world} ranks, this run has "
                              f"{engine.groups.world.size}")
    path = latest / f"rank_{engine.groups.world.rank:05d}.pt"
    try:
        state = torch.load(path, weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    try:
        engine.optimizer.load_state_dict(state["optimizer"])
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {latest}: {exc}") from None
    if engine.scaler is not None and state["scaler"] is not None:
        engine.scaler.load_state_dict(state["scaler"])
    engine.global_step = int(state["step"])
    return engine.global_step
