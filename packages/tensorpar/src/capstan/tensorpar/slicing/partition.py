"""Size checks, slicing of full tensors, and the seeded initialization scheme.

Initialization scheme ("a sliced model equals the slice of the unsliced one"):
every layer draws its *full* weight on the CPU from its own
``torch.Generator().manual_seed(seed)`` and then keeps only this rank's slice
(`slice_rows` / `slice_cols`). The draw does not depend on the tp size or rank,
so the tp=1 model built with the same seed is exactly the concatenation of the
slices. Cost: while a layer is being built, each rank holds that one layer's
full weight once (e.g. 4*d*d*4 bytes for an MLP matrix of width d), never the
whole model; for models whose single layer does not fit one rank, initialize
slices with per-slice seeds instead (that breaks tp-invariance, by design).

Sliced parameters carry ``param.tp_dim`` (the dimension split across the tp
group) so an optimizer or gradient-norm routine can tell them from replicated
ones (``tp_dim is None``); ``param.tp_fused`` says how many separately split
blocks that dimension stacks (3 for a fused qkv).
"""

from __future__ import annotations

import torch

from capstan.comm import Group

__all__ = [
    "divide", "padded_size", "slice_rows", "slice_cols", "full_normal", "mark", "tp_dim_of",
]


def divide(numerator: int, group: Group | int, what: str) -> int:
    """numerator / tp, or a ValueError naming `what` and both sizes."""
    n = group if isinstance(group, int) else group.size
    if numerator % n != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({n})")
    return numerator // n


def padded_size(size: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that holds `size` (vocabulary padding)."""
    return -(-size // multiple) * multiple


def slice_rows(full: torch.Tensor, group: Group, fused: int = 1, pad_to: int | None = None) -> torch.Tensor:
    """This rank's rows of `full` [out, ...] (column-parallel weights and biases, embeddings).

    fused: `full` stacks `fused` equal blocks along dim 0 (e.g. q, k, v); each
    block is split separately so rank r keeps [q_r; k_r; v_r] and its heads stay whole.
    pad_to: append zero rows up to this size first (vocabulary padding).
    """
    if pad_to is not None and pad_to > full.shape[0]:
        pad = torch.zeros((pad_to - full.shape[0], *full.shape[1:]), dtype=full.dtype)
        full = torch.cat([full, pad])
    block = divide(full.shape[0], fused, "fused output size") if fused > 1 else full.shape[0]
    per = divide(block, group, "output features" if fused == 1 else "fused block size")
    blocks = full.reshape(fused, block, *full.shape[1:])
    return blocks[:, group.rank * per : (group.rank + 1) * per].reshape(fused * per, *full.shape[1:]).clone()


def slice_cols(full: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's columns of `full` [out, in] (row-parallel weights)."""
    per = divide(full.shape[1], group, "input features")
    return full[:, group.rank * per : (group.rank + 1) * per].clone()


def full_normal(shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The full, unsliced N(0, std^2) tensor of a layer, from the layer's own generator (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def mark(param: torch.nn.Parameter, tp_dim: int | None, fused: int = 1) -> torch.nn.Parameter:
    """Record which dimension of `param` is split across the tp group (None: replicated).

    fused: how many separately split blocks dimension `tp_dim` stacks (3 for qkv).
    """
    param.tp_dim = tp_dim  # type: ignore[attr-defined]
    param.tp_fused = fused  # type: ignore[attr-defined]
    return param


def tp_dim_of(param: torch.Tensor) -> int | None:
    return getattr(param, "tp_dim", None)
