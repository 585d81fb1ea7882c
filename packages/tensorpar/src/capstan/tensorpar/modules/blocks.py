"""GPT-style transformer blocks built from the parallel layers.

Megatron-LM section 3, figure 3: the MLP is column-parallel fc -> GeLU ->
row-parallel proj, and self-attention is a column-parallel fused qkv (each
rank owns n_heads/tp whole heads) -> causal attention on local heads ->
row-parallel proj. Each block therefore needs exactly one `f` and one `g`
(forward: two all-reduces per transformer layer, backward: two more).

`ParallelBlock` is pre-LayerNorm (GPT-2): x + drop(attn(ln1(x))), then
x + drop(mlp(ln2(x))). With ``sequence_parallel=True`` its input and output are
[b, s/tp, d] and the norms and residual dropout run on this rank's tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from capstan.comm import Group

from ..context import ContextParallel
from ..slicing.partition import divide
from ..slicing.rng import TensorParallelRNG, dropout
from .layers import DEFAULT_STD, ColumnParallelLinear, ParallelLayerNorm, RowParallelLinear

__all__ = ["ParallelSelfAttention", "ParallelMLP", "ParallelBlock", "check_attention_sizes"]


def check_attention_sizes(d_model: int, n_heads: int, tp: int) -> int:
    """Local head count, or a ValueError naming the sizes that do not split."""
    if d_model % n_heads != 0:
        raise ValueError(f"d_model ({d_model}) is not divisible by n_heads ({n_heads})")
    return divide(n_heads, tp, "n_heads")


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with heads split across the tp group.

    Attention-probability dropout draws from the per-rank stream of `rng`:
    each rank holds different heads, so their masks must differ.

    With `cp` (a context-parallel group of more than one rank) the input holds this rank's tokens of
    the sequence and attention crosses the group (context.py: Ulysses all-to-all or a ring of key/value
    blocks); attention dropout is not available then.
    """

    def __init__(
        self, d_model: int, n_heads: int, group: Group, rng: TensorParallelRNG, *, dropout: float = 0.0,
        sequence_parallel: bool = False, seed: int = 0, proj_std: float = DEFAULT_STD,
        cp: ContextParallel | None = None,
    ) -> None:
        super().__init__()
        self.local_heads = check_attention_sizes(d_model, n_heads, group.size)
        self.cp = cp if cp is not None and cp.size > 1 else None
        if self.cp is not None and dropout > 0.0:
            raise ValueError(f"attention dropout ({dropout}) with context parallelism (cp = {cp.size}) is not "
                             "available: set dropout = 0")
        self.head_dim = d_model // n_heads
        self.group, self.rng, self.dropout = group, rng, dropout
        # q, k, v stacked along the output dim; fused=3 keeps each rank's heads whole.
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, group, fused=3, sequence_parallel=sequence_parallel,
                                        seed=seed)
        self.proj = RowParallelLinear(d_model, d_model, group, sequence_parallel=sequence_parallel,
                                      init_std=proj_std, seed=seed + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [b, s, d] (or [b, s/tp, d] with sequence parallelism)
        qkv = self.qkv(x)  # [b, s, 3 * local_heads * head_dim]
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [b, h, s, hd]
        if self.cp is not None:
            y = self.cp.attention(q, k, v)  # [b, h, s, hd]: this rank's queries over the whole sequence
        elif self.training and self.dropout > 0.0:
            # Explicit attention so the probability mask comes from this rank's own stream
            # (SDPA's internal dropout only draws from the global RNG).
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [b, h, s, s]
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu_(1)
            probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
            probs = dropout(probs, self.dropout, True, self.rng.tensor_parallel(x.device))
            y = probs @ v  # [b, h, s, hd]
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fused kernel, no dropout
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, d/tp]
        return self.proj(y)


class ParallelMLP(nn.Module):
    """fc (column-parallel) -> GeLU (tanh form, as GPT-2) -> proj (row-parallel).

    `tile` > 0 (tokens): the MLP runs on `tile` tokens of the sequence at a time, each tile recomputed in
    backward (torch.utils.checkpoint), so its ffn-wide hidden activations exist for one tile only, not
    the whole sequence (ALST's tiled MLP, Bekman et al. 2025): for the price of the MLP's forward once
    more. Every token is independent here, so the result is the untiled one."""

    def __init__(
        self, d_model: int, d_ffn: int, group: Group, *, sequence_parallel: bool = False, seed: int = 0,
        proj_std: float = DEFAULT_STD, tile: int = 0,
    ) -> None:
        super().__init__()
        divide(d_ffn, group, "FFN hidden size")
        self.tile = tile
        self.fc = ColumnParallelLinear(d_model, d_ffn, group, sequence_parallel=sequence_parallel, seed=seed)
        self.proj = RowParallelLinear(d_ffn, d_model, group, sequence_parallel=sequence_parallel,
                                      init_std=proj_std, seed=seed + 1)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [b, s, d] (or [b, s/tp, d] with sequence parallelism)
        if not self.tile or x.shape[1] <= self.tile or not torch.is_grad_enabled():
            return self._run(x)
        return torch.cat([checkpoint(self._run, part, use_reentrant=False) for part in x.split(self.tile, dim=1)],
                         dim=1)


class ParallelBlock(nn.Module):
    """Pre-LN GPT block. seed: base of this block's per-layer seeds (uses seed .. seed+3).

    Residual dropout is in the replicated region without sequence parallelism
    (same mask on every rank) and in the sliced region with it (each rank's
    tokens get their own mask), so it picks the stream accordingly.
    """

    def __init__(
        self, d_model: int, n_heads: int, group: Group, rng: TensorParallelRNG, *, ffn_mult: int = 4,
        dropout: float = 0.0, sequence_parallel: bool = False, seed: int = 0, n_layers: int = 1,
        cp: ContextParallel | None = None, mlp_tile: int = 0,
    ) -> None:
        super().__init__()
        # GPT-2 scales the init of the residual projections by 1/sqrt(2 * n_layers).
        proj_std = DEFAULT_STD / math.sqrt(2 * n_layers)
        sp = sequence_parallel
        self.group, self.rng, self.dropout, self.sequence_parallel = group, rng, dropout, sp
        self.ln1 = ParallelLayerNorm(d_model, group, sequence_parallel=sp)
        self.attn = ParallelSelfAttention(d_model, n_heads, group, rng, dropout=dropout, sequence_parallel=sp,
                                          seed=seed, proj_std=proj_std, cp=cp)
        self.ln2 = ParallelLayerNorm(d_model, group, sequence_parallel=sp)
        self.mlp = ParallelMLP(d_model, ffn_mult * d_model, group, sequence_parallel=sp, seed=seed + 2,
                               proj_std=proj_std, tile=mlp_tile)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        gen = self.rng.tensor_parallel(x.device) if self.sequence_parallel else self.rng.replicated(x.device)
        return dropout(x, self.dropout, self.training, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [b, s, d] replicated, or [b, s/tp, d] with sequence parallelism
        x = x + self._drop(self.attn(self.ln1(x)))
        return x + self._drop(self.mlp(self.ln2(x)))
