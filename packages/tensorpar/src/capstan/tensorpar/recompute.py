"""Activation recomputation ("activation checkpointing") of a block, with its dropout masks replayed.

A recomputed block keeps only its input in forward and runs its forward again
inside backward to rebuild what the gradients need (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost"; Megatron-LM's full
recompute): activation memory per block drops to one tensor of the residual
stream, for about one extra forward per step.

torch.utils.checkpoint restores torch's global generator before it
recomputes, but capstan's dropout draws from `TensorParallelRNG`'s own
generators, which have moved on by then: the recomputed masks would differ
from the forward's, and the gradients with them. `recompute(block)` saves the
block's streams when its forward runs, sets them back around the
recomputation, and afterwards returns them to where they were, so the next
step's masks continue the same sequence as without recomputation: training
is the same, value for value.

The module and its parameter names stay as they are (its `forward` is
replaced on the instance), so checkpoints, chunked memory and pipeline stages
see the same model; its children run through their own ``__call__`` in both
passes, so their hooks (capstan.chunkmem's parameter fetches) fire in the
recomputation too.
"""

from __future__ import annotations

import types
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute", "is_recomputed", "InputKeeper"]

_MARK = "_capstan_recompute"
_KEEPER = "_capstan_input_keeper"


def is_recomputed(module: nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


class InputKeeper(Protocol):
    """Where a recomputed block's input waits for its recompute (capstan.chunkmem.ActivationOffload):
    `offload(x)` after the forward moves x's values out and frees its storage (returning a handle, or None
    to keep x as it is); `restore(handle)` before the recompute gives them back."""

    def offload(self, x: torch.Tensor) -> object | None: ...

    def restore(self, handle: object | None) -> None: ...


def _recomputed_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The forward `recompute` installs, bound to the block (so a deepcopy rebinds it to the copy)."""
    inner = type(self).forward
    if not torch.is_grad_enabled():
        return inner(self, x, *args, **kwargs)
    rng = getattr(self, "rng", None)
    keeper: InputKeeper | None = getattr(self, _KEEPER, None)
    saved = rng.get_states(x.device) if rng is not None else None
    first, handle = [True], [None]

    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if first[0]:  # the forward itself: draw as usual
            first[0] = False
            return inner(self, x, *args, **kwargs)
        if keeper is not None:  # the recomputation: the input's values back first
            keeper.restore(handle[0])
        if saved is None:
            return inner(self, x, *args, **kwargs)
        now = rng.get_states(x.device)  # replay the forward's masks
        rng.set_states(saved)
        try:
            return inner(self, x, *args, **kwargs)
        finally:
            rng.set_states(now)

    y = checkpoint(run, x, *args, use_reentrant=False, **kwargs)
    if keeper is not None:
        handle[0] = keeper.offload(x)
    return y


def recompute(block: nn.Module, keeper: InputKeeper | None = None) -> nn.Module:
    """Make `block` recompute its activations in backward (in place; returns it; idempotent).

    The block's dropout streams are those of its ``rng`` attribute (a
    TensorParallelRNG, as tensorpar's blocks have); a block without one may
    only use torch's global generator, which torch.utils.checkpoint replays.
    Without gradients (evaluation) the forward runs as it is. `keeper` (InputKeeper) takes the block's
    input away between its forward and its recompute (activation offload); it may be set again later.
    """
    if keeper is not None:
        setattr(block, _KEEPER, keeper)
    if is_recomputed(block):
        return block
    block.forward = types.MethodType(_recomputed_forward, block)  # type: ignore[method-assign]
    setattr(block, _MARK, True)
    return block
