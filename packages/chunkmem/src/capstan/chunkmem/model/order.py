"""The order in which registration packs modules: creation order, or execution order from one traced forward.

`module_order(model, "modules")` is `named_modules()` (creation order, which
is execution order for sequential models). `module_order(model, "trace",
example_inputs)` runs one forward without gradients and orders the modules
by their first call (a forward pre-hook records it); the subtree of an
atomic module (whose forward reads its submodules' parameters directly)
follows it in creation order, and modules never called come last in creation
order. Registration then packs the parameters in that order, so a forward
touches chunks front to back even when the model builds its layers in
another order than it runs them.

A model on the meta device is traced on the meta device: tensor inputs are
moved there and tensors the forward creates are made there (shapes only, no
compute, nothing is allocated), so a model far larger than RAM can be
ordered before any of it is materialized. A materialized model's trace
leaves its buffers and the random number generator as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["module_order", "ORDERS"]

ORDERS = ("modules", "trace")


def _to_meta(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def module_order(model: nn.Module, order: str, example_inputs: Sequence[object] | None = None,
                 atomic_types: tuple[type[nn.Module], ...] = ()) -> list[tuple[str, nn.Module]]:
    """(name, module) pairs in the order registration should take them (every module exactly once)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    named = list(model.named_modules())
    if order == "modules":
        if example_inputs is not None:
            raise ValueError("example_inputs are only used with order='trace'")
        return named
    if example_inputs is None:
        raise ValueError("order='trace' needs example_inputs= (the positional arguments of one forward)")
    tensors = [*model.parameters(), *model.buffers()]
    on_meta = [t.is_meta for t in tensors]
    if any(on_meta) and not all(on_meta):
        raise ValueError("order='trace' needs a model entirely on the meta device or entirely materialized; "
                         "this one is partly on the meta device")
    args = tuple(example_inputs)
    if on_meta and all(on_meta):
        args = tuple(_to_meta(a) for a in args)
    called: dict[int, int] = {}  # id(module) -> position of its first call

    def record(module: nn.Module, _args: object) -> None:
        called.setdefault(id(module), len(called))

    handles = [m.register_forward_pre_hook(record) for _, m in named]
    # A real model's trace must leave no trace: buffers (BatchNorm statistics) are restored and
    # the random number generator (dropout) is forked. On the meta device nothing is computed, and
    # tensors the forward creates itself (torch.arange of positions) are made there too.
    saved = {} if any(on_meta) else {n: b.clone() for n, b in model.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                (torch.device("meta") if any(on_meta) else contextlib.nullcontext()):
            model(*args)
    except Exception as e:  # noqa: BLE001 - re-raised with what to do about it
        where = "on the meta device (example inputs moved there)" if any(on_meta) else "without gradients"
        raise RuntimeError(
            f"order='trace' could not run one forward of {type(model).__name__} {where}: {e}; pass "
            "example_inputs the model's forward accepts, or use order='modules'") from e
    finally:
        for h in handles:
            h.remove()
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for n, b in saved.items():
                buffers[n].copy_(b)
    ranked = sorted((pos, i) for i, (_, m) in enumerate(named) if (pos := called.get(id(m))) is not None)
    out: list[tuple[str, nn.Module]] = []
    placed: set[int] = set()

    def place(name: str, module: nn.Module) -> None:
        if id(module) in placed:
            return
        placed.add(id(module))
        out.append((name, module))
        if isinstance(module, atomic_types):  # its submodules' parameters are used with it
            for sub_name, sub in module.named_modules(prefix=name):
                place(sub_name, sub)

    for _, i in ranked:
        place(*named[i])
    for name, module in named:  # never called: last, in creation order
        place(name, module)
    return out
