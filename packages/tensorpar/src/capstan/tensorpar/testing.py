"""Parity helpers: compare a tensor-parallel model with its unsliced twin.

Both `build_gpt` and `parallelize` keep the module and parameter names of the
dense model, so a sliced model and the tp=1 model can be matched name by name;
each sliced parameter says how it was split (``tp_dim``, ``tp_fused``), which
is all that is needed to cut the reference's tensors the same way. The
engine's parity tests reuse these.

    errs = grad_errors(sliced_model, full_model, groups.tp)   # {name: relative error}
"""

from __future__ import annotations

import torch
from torch import nn

from capstan.comm import Group

from .slicing.partition import tp_dim_of

__all__ = ["rel_err", "local_part", "param_errors", "grad_errors"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are zero).

    A norm-wise error, not element-wise: reordered fp32 sums leave absolute
    errors of a few ulps of the *largest* terms, which would look huge
    relative to elements that happen to be near zero.
    """
    if got.shape != want.shape:
        raise ValueError(f"shape mismatch: got {tuple(got.shape)}, want {tuple(want.shape)}")
    g, w = got.detach().double(), want.detach().double()
    denom = w.norm().item()
    diff = (g - w).norm().item()
    return diff if denom == 0.0 else diff / denom


def local_part(full: torch.Tensor, like: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's part of the dense `full`, cut the way the sliced parameter `like` was."""
    dim = tp_dim_of(like)
    if dim is None:
        return full
    fused = getattr(like, "tp_fused", 1)
    per = like.shape[dim] // fused  # rows of one fused block on this rank
    padded = per * group.size * fused
    if full.shape[dim] < padded:  # zero padding (vocabulary)
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, torch.zeros(pad_shape, dtype=full.dtype, device=full.device)], dim=dim)
    blocks = full.chunk(fused, dim=dim)
    return torch.cat([b.narrow(dim, group.rank * per, per) for b in blocks], dim=dim)


def _pairs(sliced: nn.Module, full: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    dense = dict(full.named_parameters())
    out = []
    for name, p in sliced.named_parameters():
        if name not in dense:
            raise KeyError(f"parameter {name!r} of the sliced model has no twin in the full model")
        out.append((name, p, dense[name]))
    return out


def param_errors(sliced: nn.Module, full: nn.Module, group: Group) -> dict[str, float]:
    """Relative error of every sliced parameter against its part of the full model's."""
    return {n: rel_err(p, local_part(q, p, group)) for n, p, q in _pairs(sliced, full)}


def grad_errors(sliced: nn.Module, full: nn.Module, group: Group) -> dict[str, float]:
    """Relative error of every sliced gradient against its part of the full model's gradient."""
    errs = {}
    for n, p, q in _pairs(sliced, full):
        if p.grad is None or q.grad is None:
            raise ValueError(f"parameter {n!r} has no gradient (sliced: {p.grad is not None}, "
                             f"full: {q.grad is not None})")
        errs[n] = rel_err(p.grad, local_part(q.grad, p, group))
    return errs
