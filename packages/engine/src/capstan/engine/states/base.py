"""`ModelStates`: what an `Engine` asks of the holder of its model states, whichever it is.

The engine (engine.py) owns the step's three calls, the loss, the pipeline schedule, loss scaling and
the reports; a `ModelStates` owns the parameters, gradients and optimizer states and everything that
depends on where they are: the optimizer step, what a backward does at its end, the memory figures of
the states, a copy of the parameters, their view for checkpoints (FlatView, ChunkView), and what the
trainer's log and `close` need. Two
implementations: `FlatStates` (flat.py, ZeRO 0-2 on a flat fp32 buffer) and `ChunkedStates`
(chunked.py, capstan.chunkmem: offload and ZeRO-3). Nothing outside them branches on which one it is;
`chunked` says which, for reports and checkpoints' choice of view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

__all__ = ["ModelStates", "overflowed", "UpdateScale"]

# engine._update_scale(overflow, step, where): the loss scaler's update, raising at the minimum scale
UpdateScale = Callable[[bool, int, str], None]


class ModelStates(ABC):
    """The interface (module docstring). `module` is what forward runs; `optimizer` steps it."""

    chunked: bool
    module: nn.Module
    optimizer: object

    @abstractmethod
    def begin_step(self) -> None:
        """Before the first forward of a step (once per step; chunks start the step's trace)."""

    @abstractmethod
    def backward(self, scaled: torch.Tensor, completes_step: bool, lr: float, scale: float | None) -> None:
        """Backward of one micro-batch's scaled loss; `completes_step`: the last of the step's micro-batches
        (the overlapped optimizer arms for it, with this step's learning rate and loss scale; `scale` as in
        `step`)."""

    @abstractmethod
    def pipeline_step(self, run: Callable[[], torch.Tensor], arrivals: int, lr: float,
                      scale: float | None) -> torch.Tensor:
        """All micro-batches through a pipeline schedule (`run` runs it and returns the mean loss), with
        what the states need around it; `arrivals` gradients per parameter."""

    @abstractmethod
    def step(self, info: object, scale: float | None, update_scale: UpdateScale) -> None:
        """The optimizer step: fills info.grad_norm, info.loss_scale, info.skipped (`scale`: the fp16 loss
        scale, None without loss scaling; `update_scale` the scaler's update)."""

    @abstractmethod
    def eval_context(self) -> AbstractContextManager[None]:
        """Around an evaluation between steps (chunk accesses there stay out of the step's trace)."""

    def flush_pending(self) -> None:
        """Run any update a step left to the next forward (chunked states on disk: chunkmem's "Deferred
        update"); nothing for the others."""
        return None

    @abstractmethod
    def stats(self, device: torch.device) -> dict[str, float]:
        """`mem.<tier>.peak_bytes` / `resident_bytes`, `mem.moved_bytes` (and the disk's, the stall) of the
        model states, and the process's peak RSS."""

    @abstractmethod
    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of this rank's parameters by name."""

    @abstractmethod
    def raw_module(self) -> nn.Module:
        """The user's module (under a chunked wrapper where there is one): checkpoints name parameters in it."""

    @abstractmethod
    def checkpoint_view(self, engine: object) -> object:
        """This rank's state as checkpoints read and write it (a checkpoint.state.StateView: canonical
        parameter names, the elements this rank owns, reads and writes of param / exp_avg / exp_avg_sq)."""

    def disk_file_bytes(self) -> int:
        """The bytes of this rank's disk tier's file: the space it takes (0 without one)."""
        return 0

    def describe(self) -> str:
        """A note for the run log's first line ("" when there is nothing to say)."""
        return ""

    def ram_timeline(self) -> tuple[list, int] | None:
        """The last step's RAM at every chunk access and all the states' bytes, where they are tracked."""
        return None

    def close(self) -> None:  # noqa: B027  (nothing to release by default; chunks override)
        """Release what the states hold beyond memory (threads, files)."""
        return None


def overflowed(names: list[str], shown: int = 3) -> str:
    """The overflow message's tail naming this rank's overflowing parameters (the first `shown`, then
    "and N more"); "" when this rank has none (another rank's gradients overflowed)."""
    if not names:
        return ""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f" (inf/NaN on this rank in the gradients of {', '.join(names[:shown])}{more})"
