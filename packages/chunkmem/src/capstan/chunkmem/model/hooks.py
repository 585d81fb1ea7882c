"""The module and gradient hooks through which a `ChunkedModel` moves its parameters (PatrickStar's scheme).

* forward pre-hook of a module: its parameters' chunks are accessed (made
  resident and pinned) and `param.data` becomes a view into the chunk;
* forward hook: released (HOLD_AFTER_FWD) — the chunk may be evicted, and
  `param.data` then points at an empty tensor; the module's outputs are
  wrapped so that their backward re-accesses the parameters first;
* after a parameter's gradient is accumulated: it is added into the GRAD
  chunk, `param.grad` is dropped, and the parameter is released
  (HOLD_AFTER_BWD). A parameter used by several modules (tied weights) is
  pinned once per use and released after its single gradient hook.

Where no chunk can move (RAM unbounded, no disk tier, nothing sharded:
`ChunkedModel._chunks_stay_put`) the module hooks are not installed at all:
parameters stay bound to their slots and only gradients that do not
accumulate straight into a chunk need their hook.

Activation checkpointing works because recomputation simply runs the
forward hooks again inside backward. The hooks call the model's `access_param`,
`release_param` and `grad_arrived`, which the sharded model overrides to gather
and reduce (sharding.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .states import TensorState

if TYPE_CHECKING:
    from .chunked import ChunkedModel, ParamHome

__all__ = ["install_hooks"]


class _PreBackward(torch.autograd.Function):
    """Identity whose backward calls `hook` first: re-access a module's parameters before its backward."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.hook = hook
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.hook()
        return (None, *grads)


def install_hooks(model: ChunkedModel, modules: bool, grads: bool) -> None:
    """modules: forward hooks on every module with parameters (access/release, pre-backward);
    grads: a post-accumulate hook on every trainable parameter."""
    if modules:
        for module in model.hooked_modules():
            homes = model.module_homes(module)
            if not homes:
                continue
            module.register_forward_pre_hook(_pre_forward(model, homes))
            module.register_forward_hook(_post_forward(model, homes))
    if grads:
        for home in model.homes.values():
            if home.param.requires_grad:
                home.param.register_post_accumulate_grad_hook(_grad_hook(model, home))


def _pre_forward(model: ChunkedModel, homes: list[ParamHome]) -> Callable[..., None]:
    def hook(module: nn.Module, args: object) -> None:
        run = model.pending_update  # (None again once the last one ran)
        if run is not None:  # updates left from the last step (adam.py): all before any access,
            for home in homes:  # so that one group's siblings are all the update pins
                run(home.group, home.index)
        for home in homes:
            model.access_param(home)
    return hook


def _post_forward(model: ChunkedModel, homes: list[ParamHome]) -> Callable[..., object]:
    def pre_backward() -> None:
        for home in homes:
            model.access_param(home)

    def hook(module: nn.Module, args: object, output: object) -> object:
        for home in homes:
            model.release_param(home, TensorState.HOLD_AFTER_FWD)
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return _PreBackward.apply(pre_backward, output)
        if isinstance(output, tuple):
            idx = [i for i, t in enumerate(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if idx:
                wrapped = _PreBackward.apply(pre_backward, *(output[i] for i in idx))
                wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
                out = list(output)
                for i, t in zip(idx, wrapped):
                    out[i] = t
                return type(output)(out) if type(output) is tuple else out
        return output
    return hook


def _grad_hook(model: ChunkedModel, home: ParamHome) -> Callable[[nn.Parameter], None]:
    def hook(param: nn.Parameter) -> None:
        assert param.grad is not None
        if not model.resident_grads:  # else autograd already accumulated into the chunk slot
            model.grad_arrived(home, param.grad)
            param.grad = None
        model.release_param(home, TensorState.HOLD_AFTER_BWD, all_pins=True)
        if model.grad_listener is not None:
            model.grad_listener(home.group, home.index)
    return hook
