"""Tensor-parallel building blocks: column/row-parallel linear, vocab-parallel embedding, norms.

Each layer takes the tensor-parallel `Group` in its constructor (never a global)
and is the plain layer on a group of one. Weights are drawn whole from the
layer's `seed` and sliced (see `partition`), or sliced from given full tensors
(``full_weight=`` / ``full_bias=``, which is how `parallelize` converts a dense
model). Shapes are batch-first: ``[b, s, h]``; under sequence parallelism the
input and output of the tp region are ``[b, s/tp, h]``.

Example (one process; identical code on tp ranks with ``groups.tp``)::

    from capstan import comm
    tp = comm.single_process_groups().tp
    fc = ColumnParallelLinear(64, 256, tp, seed=1)
    proj = RowParallelLinear(256, 64, tp, seed=2)
    y = proj(torch.nn.functional.gelu(fc(torch.randn(2, 8, 64))))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from capstan.comm import Group

from ..slicing.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from ..slicing.partition import divide, full_normal, mark, padded_size, slice_cols, slice_rows

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLayerNorm",
           "ParallelRMSNorm"]

DEFAULT_STD = 0.02  # GPT-2's initializer range


def _host(t: torch.Tensor) -> torch.Tensor:
    """A full (unsliced) initial value on the CPU for slicing; a meta tensor stays meta (a model
    built under `torch.device("meta")` gets its values later, e.g. straight into chunks)."""
    return t.detach() if t.is_meta else t.detach().cpu()


def _param(
    t: torch.Tensor, tp_dim: int | None, dtype: torch.dtype, device: torch.device | str | None, fused: int = 1
) -> nn.Parameter:
    return mark(nn.Parameter(t.to(dtype=dtype, device=device)), tp_dim, fused)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A [out, in] split by rows (output features) across the group.

    Megatron-LM section 3, equation (3): splitting A column-wise (in its X A
    convention) lets each rank apply a non-linearity to its own output slice
    with no communication. The input enters through `f` (or, with sequence
    parallelism, an all-gather of the sequence).

    gather_output: all-gather the output slices into the full [.., out] (e.g. a
        replicated LM head); otherwise the output stays [.., out/tp].
    fused: A stacks `fused` equal blocks (q, k, v: fused=3), each split
        separately so a rank's rows are [q_r; k_r; v_r] and its heads stay whole.
    pad_output: pad `out` with zero rows up to a multiple of tp (vocab heads).
    """

    def __init__(
        self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
        gather_output: bool = False, sequence_parallel: bool = False, fused: int = 1, pad_output: bool = False,
        init_std: float = DEFAULT_STD, seed: int = 0, full_weight: torch.Tensor | None = None,
        full_bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if fused > 1 and (gather_output or pad_output):
            raise ValueError("a fused (e.g. qkv) column-parallel layer cannot gather or pad its output: "
                             "the gathered order would be [q0 k0 v0 q1 ...], not [q k v]")
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.gather_output, self.sequence_parallel, self.fused = gather_output, sequence_parallel, fused
        self.out_features_padded = padded_size(out_features, group.size) if pad_output else out_features
        if fused > 1:
            divide(divide(out_features, fused, "fused output features"), group, "output features per fused block")
        else:
            divide(self.out_features_padded, group, "output features")
        if full_weight is None:
            full_weight = full_normal((out_features, in_features), init_std, seed)
        if tuple(full_weight.shape) != (out_features, in_features):
            raise ValueError(
                f"full_weight has shape {tuple(full_weight.shape)}, expected {(out_features, in_features)}"
            )
        pad_to = self.out_features_padded
        self.weight = _param(slice_rows(_host(full_weight), group, fused, pad_to), 0, dtype, device, fused)
        if bias:
            full_bias = torch.zeros(out_features) if full_bias is None else _host(full_bias)
            self.bias = _param(slice_rows(full_bias, group, fused, pad_to), 0, dtype, device, fused)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [b, s, in] replicated, or [b, s/tp, in] with sequence parallelism
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # [b, s, out/tp]
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.group)[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.group.size}, "
                f"fused={self.fused}, gather_output={self.gather_output}, sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A [out, in] split by columns (input features) across the group.

    Megatron-LM section 3: each rank multiplies its slice of the input features
    and the partial products are summed by `g` (or, with sequence parallelism,
    reduce-scattered along the sequence). The bias is replicated and added
    after the sum; under sequence parallelism each rank only sees its own
    tokens, so the bias enters through `f` and its gradient is all-reduced.

    input_is_parallel: the input is already [.., in/tp] (output of a column-
        parallel layer); otherwise the full input is split here.
    """

    def __init__(
        self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
        input_is_parallel: bool = True, sequence_parallel: bool = False, init_std: float = DEFAULT_STD,
        seed: int = 0, full_weight: torch.Tensor | None = None, full_bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True (the input of the tp region)")
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        divide(in_features, group, "input features")
        if full_weight is None:
            full_weight = full_normal((out_features, in_features), init_std, seed)
        if tuple(full_weight.shape) != (out_features, in_features):
            raise ValueError(
                f"full_weight has shape {tuple(full_weight.shape)}, expected {(out_features, in_features)}"
            )
        self.weight = _param(slice_cols(_host(full_weight), group), 1, dtype, device)
        if bias:
            full_bias = torch.zeros(out_features) if full_bias is None else _host(full_bias)
            self.bias = _param(full_bias.clone(), None, dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [b, s, in/tp] (input_is_parallel) or [b, s, in]
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        y = F.linear(x, self.weight)  # partial sums [b, s, out]
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)  # [b, s/tp, out]
        else:
            y = reduce_from_tensor_parallel_region(y, self.group)  # [b, s, out]
        if self.bias is not None:
            b = copy_to_tensor_parallel_region(self.bias, self.group) if self.sequence_parallel else self.bias
            y = y + b
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.group.size}, "
                f"input_is_parallel={self.input_is_parallel}, sp={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab, d] split by vocabulary rows across the group.

    Megatron-LM section 3 ("input embedding"): each rank looks up the tokens in
    its vocabulary range, writes zeros for the others, and the partial rows are
    summed by `g` (reduce-scattered along the sequence with sequence
    parallelism). A vocabulary not divisible by tp is padded with zero rows
    that no valid token id reaches, so the result equals the unpadded table.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, group: Group, *, sequence_parallel: bool = False,
        init_std: float = DEFAULT_STD, seed: int = 0, full_weight: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.group, self.num_embeddings, self.embedding_dim = group, num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.num_embeddings_padded = padded_size(num_embeddings, group.size)
        self.per_rank = self.num_embeddings_padded // group.size
        self.vocab_start = group.rank * self.per_rank
        if full_weight is None:
            full_weight = full_normal((num_embeddings, embedding_dim), init_std, seed)
        if tuple(full_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"full_weight has shape {tuple(full_weight.shape)}, "
                             f"expected {(num_embeddings, embedding_dim)}")
        local = slice_rows(_host(full_weight), group, pad_to=self.num_embeddings_padded)
        self.weight = _param(local, 0, dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [b, s] int64 -> [b, s, d] (or [b, s/tp, d] with sequence parallelism)
        if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"token ids must be in [0, {self.num_embeddings}), got range "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        if self.group.size == 1:
            out = F.embedding(ids, self.weight)
        else:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)
        return reduce_from_tensor_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.num_embeddings_padded}), {self.embedding_dim}, "
                f"tp={self.group.size}, sp={self.sequence_parallel}")


class ParallelLayerNorm(nn.Module):
    """LayerNorm with replicated parameters, usable inside a sequence-parallel region.

    Under sequence parallelism (Korthikanti et al. 2022, section 4.2.2) each rank
    normalizes only its tokens, so the gradient of the shared weight and bias is
    a partial sum; routing them through `f` all-reduces those gradients in
    backward, inside autograd, with no optimizer hook to remember.
    """

    def __init__(
        self, normalized_shape: int, group: Group, *, sequence_parallel: bool = False, eps: float = 1e-5,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.eps = group, sequence_parallel, eps
        self.normalized_shape = (normalized_shape,)
        self.weight = _param(torch.ones(normalized_shape), None, dtype, device)
        self.bias = _param(torch.zeros(normalized_shape), None, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = copy_to_tensor_parallel_region(w, self.group)
            b = copy_to_tensor_parallel_region(b, self.group)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class ParallelRMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019; Llama's norm) with a replicated weight, usable inside a
    sequence-parallel region: as for `ParallelLayerNorm`, the weight goes through `f` under
    sequence parallelism so its partial gradients are all-reduced over the tp group."""

    def __init__(
        self, normalized_shape: int, group: Group, *, sequence_parallel: bool = False, eps: float = 1e-6,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.eps = group, sequence_parallel, eps
        self.normalized_shape = (normalized_shape,)
        self.weight = _param(torch.ones(normalized_shape), None, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.sequence_parallel:
            w = copy_to_tensor_parallel_region(w, self.group)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)

