"""A small reference GPT built from the tensor-parallel layers, as a flat list of layers.

``model.layers`` is [GPTEmbedding, ParallelBlock x n_layers, GPTFinalNorm, GPTHead];
each layer maps one tensor to one tensor, so a pipeline can cut the list
anywhere. The LM head is *untied* from the token embedding: every layer owns
its parameters, so pipeline stages never need the cross-stage gradient sync a
tied embedding would (cost: one more vocab x d_model matrix).

Outputs are vocabulary-split logits [b, s, vocab_padded/tp]; `model.loss`
applies `vocab_parallel_cross_entropy` without gathering them, and
`gather_vocab_logits` assembles full logits when really needed.

Example (one process; the same call on every tp rank with ``groups.tp``)::

    from capstan import comm
    from capstan.tensorpar import GPTConfig, build_gpt
    cfg = GPTConfig(vocab_size=100, seq_len=16, d_model=32, n_heads=4, n_layers=2, dropout=0.0)
    model = build_gpt(cfg, comm.single_process_groups().tp, seed=0)
    ids = torch.randint(0, 100, (2, 16))
    loss = model.loss(model(ids), ids)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from capstan.comm import Group

from ..context import ContextParallel
from ..slicing.mappings import copy_to_tensor_parallel_region, gather_from_sequence_parallel_region
from ..slicing.partition import divide, full_normal, mark
from ..slicing.rng import TensorParallelRNG, dropout
from .blocks import ParallelBlock, check_attention_sizes
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, ParallelLayerNorm, VocabParallelEmbedding
from .tiled_loss import default_tile, tiled_head_cross_entropy

__all__ = ["GPTConfig", "GPT", "GPTEmbedding", "GPTFinalNorm", "GPTHead", "build_gpt", "build_gpt_layers",
           "gpt_layer_factories", "gpt_loss", "loss_targets"]

WPE_STD = 0.01  # GPT-2's position-embedding init


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the reference GPT."""

    vocab_size: int
    """Number of token ids; need not divide by tp (the vocabulary is padded)."""
    seq_len: int
    """Maximum sequence length (rows of the position embedding)."""
    d_model: int
    """Hidden size; must divide by n_heads."""
    n_heads: int
    """Attention heads; must divide by the tp size."""
    n_layers: int
    """Transformer blocks."""
    dropout: float
    """Dropout on embeddings, attention probabilities and residual branches."""
    ffn_mult: int = 4
    """MLP hidden size = ffn_mult * d_model."""
    loss_tile: int = 0
    """Tokens per tile of the head's tiled cross-entropy (GPTHead.tiled_loss, used under `loss_targets`): 0 off
    (logits), -1 the default size (tiled_loss.default_tile)."""
    mlp_tile: int = 0
    """Tokens per tile of each block's MLP (ParallelMLP.tile): 0 off."""

    def __post_init__(self) -> None:
        if self.loss_tile < -1 or self.mlp_tile < 0:
            raise ValueError(f"GPTConfig.loss_tile must be -1, 0 or positive and mlp_tile 0 or positive, got "
                             f"{self.loss_tile} and {self.mlp_tile}")
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "ffn_mult"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class GPTEmbedding(nn.Module):
    """Token ids [b, s] -> hidden [b, s, d] (or this rank's tokens [b, s/tp, d] with sequence parallelism)."""

    def __init__(self, config: GPTConfig, group: Group, rng: TensorParallelRNG, *, sequence_parallel: bool,
                 seed: int, cp: ContextParallel | None = None) -> None:
        super().__init__()
        self.group, self.rng, self.dropout, self.sequence_parallel = group, rng, config.dropout, sequence_parallel
        self.cp = cp if cp is not None and cp.size > 1 else None  # ids are this rank's tokens (context.py)
        self.seq_len = config.seq_len
        self.wte = VocabParallelEmbedding(config.vocab_size, config.d_model, group,
                                          sequence_parallel=sequence_parallel, seed=seed)
        self.wpe = mark(nn.Parameter(full_normal((config.seq_len, config.d_model), WPE_STD, seed + 1)), None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        whole = s * (self.cp.size if self.cp is not None else 1)
        if whole > self.seq_len:
            raise ValueError(f"sequence of {whole} tokens exceeds GPTConfig.seq_len={self.seq_len}")
        x = self.wte(ids)  # [b, s, d], or [b, s/tp, d] reduce-scattered
        # this rank's positions: 0..s-1, or with cp its tokens' places in the whole sequence
        pos = self.cp.positions(s, x.device) if self.cp is not None else torch.arange(s, device=x.device)
        if self.sequence_parallel:
            local = divide(s, self.group, "sequence length (sequence parallelism)")
            start = self.group.rank * local
            # Each rank adds only its positions: the replicated table's gradient is partial, so `f`.
            wpe = copy_to_tensor_parallel_region(self.wpe, self.group)
            x = x + (wpe[start : start + local] if self.cp is None else wpe[pos[start : start + local]])
            gen = self.rng.tensor_parallel(x.device)
        else:
            x = x + (self.wpe[:s] if self.cp is None else self.wpe[pos])
            gen = self.rng.replicated(x.device)
        return dropout(x, self.dropout, self.training, gen)


class GPTFinalNorm(ParallelLayerNorm):
    """The last LayerNorm, a layer of its own so a pipeline can place it."""


_TARGETS: ContextVar[torch.Tensor | None] = ContextVar("capstan_gpt_targets", default=None)


@contextmanager
def loss_targets(targets: torch.Tensor | None) -> Iterator[None]:
    """Within this block a GPTHead with a loss tile (`tiled_loss`) returns per-token losses against `targets`
    instead of logits: the trainer sets it around a forward whose targets it knows."""
    token = _TARGETS.set(targets)
    try:
        yield
    finally:
        _TARGETS.reset(token)


class GPTHead(ColumnParallelLinear):
    """hidden [b, s(/tp), d] -> vocabulary-split logits [b, s, vocab_padded/tp] (no bias, untied).

    With `tiled_loss` set (tokens per tile; `True`: tiled_loss.default_tile) and targets given by
    `loss_targets`, it returns each token's loss instead, computed a tile at a time so the logits never
    exist whole (tiled_loss.py); `gpt_loss` / `GPT.loss` then take their mean."""

    tiled_loss: int | bool = False
    vocab_size: int | None = None
    logits_peak: int = 0  # the most bytes of logits one forward made at once since `take_logits_peak`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        targets = _TARGETS.get()
        if not self.tiled_loss or targets is None:
            logits = super().forward(x)
            self.logits_peak = max(self.logits_peak, logits.nbytes)
            return logits
        # x: [b, s, d] (or [b, s/tp, d] with sequence parallelism): the input mapping of the column layer
        x = gather_from_sequence_parallel_region(x, self.group) if self.sequence_parallel else \
            copy_to_tensor_parallel_region(x, self.group)
        tile = int(self.tiled_loss) if self.tiled_loss is not True else default_tile(self.weight.shape[0], x.device)
        tokens = x.numel() // x.shape[-1]
        self.logits_peak = max(self.logits_peak, min(tile, tokens) * self.weight.shape[0] * 4)  # one fp32 tile
        # The losses under loss_targets reach GPT.loss / gpt_loss, which take their mean: uniform gradients.
        return tiled_head_cross_entropy(x, self.weight, targets, self.group, self.vocab_size, tile,
                                        uniform_grad=True)

    def take_logits_peak(self) -> int:
        """The most bytes of logits (one tile's, with the tiled loss) since the last call."""
        peak, self.logits_peak = self.logits_peak, 0
        return peak


def _token_losses(out: torch.Tensor, targets: torch.Tensor) -> bool:
    """Whether a head's output is its per-token losses (shaped as the targets) rather than logits (one more
    dimension, the vocabulary)."""
    return out.shape == targets.shape


class GPT(nn.Module):
    """The layers in order, plus the loss. Build with `build_gpt`."""

    def __init__(self, config: GPTConfig, layers: list[nn.Module], group: Group, rng: TensorParallelRNG,
                 sequence_parallel: bool) -> None:
        super().__init__()
        self.config, self.tp_group, self.rng, self.sequence_parallel = config, group, rng, sequence_parallel
        self.layers = nn.ModuleList(layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss from vocabulary-split logits (or the tiled head's per-token losses); the same
        value on every tp rank."""
        if _token_losses(logits, targets):
            return logits.mean()
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group, self.config.vocab_size).mean()


def gpt_layer_factories(config: GPTConfig, tp_group: Group, seed: int, *, sequence_parallel: bool = False,
                        rng: TensorParallelRNG | None = None,
                        cp: ContextParallel | None = None) -> list[Callable[[], nn.Module]]:
    """One zero-argument builder per layer of `model.layers` (n_layers + 3 of them), in order.

    Each builder gives its layer exactly the values it has in `build_gpt(config, tp_group, seed)`:
    every parameter draws from a seed derived from `seed` and the layer's index, never from the
    global generator, so a pipeline stage can build only its own layers (`build_gpt_layers`, or
    these factories as `capstan.pipeline.LayerSpec`s) and still equal the whole model. With `cp` the
    layers take this rank's tokens of each sequence (context.py); their parameters are the same.
    """
    check_attention_sizes(config.d_model, config.n_heads, tp_group.size)
    divide(config.ffn_mult * config.d_model, tp_group, "FFN hidden size (ffn_mult * d_model)")
    if sequence_parallel:
        divide(config.seq_len, tp_group, "seq_len (sequence parallelism)")
    base = seed * 10_007  # per-layer seeds: base + 4 * index + k, k < 4
    rng = rng or TensorParallelRNG(tp_group, seed)
    sp = sequence_parallel

    def block(i: int) -> Callable[[], nn.Module]:
        return lambda: ParallelBlock(config.d_model, config.n_heads, tp_group, rng, ffn_mult=config.ffn_mult,
                                     dropout=config.dropout, sequence_parallel=sp, seed=base + 4 * (i + 1),
                                     n_layers=config.n_layers, cp=cp, mlp_tile=config.mlp_tile)

    return [lambda: GPTEmbedding(config, tp_group, rng, sequence_parallel=sp, seed=base, cp=cp),
            *(block(i) for i in range(config.n_layers)),
            lambda: GPTFinalNorm(config.d_model, tp_group, sequence_parallel=sp),
            lambda: _head(config, tp_group, sp, base + 4 * (config.n_layers + 1))]


def _head(config: GPTConfig, tp_group: Group, sp: bool, seed: int) -> GPTHead:
    head = GPTHead(config.d_model, config.vocab_size, tp_group, bias=False, pad_output=True, sequence_parallel=sp,
                   seed=seed)
    head.tiled_loss = True if config.loss_tile == -1 else config.loss_tile
    head.vocab_size = config.vocab_size
    return head


def build_gpt_layers(config: GPTConfig, tp_group: Group, seed: int, start: int = 0, stop: int | None = None, *,
                     sequence_parallel: bool = False, cp: ContextParallel | None = None) -> list[nn.Module]:
    """Layers ``start:stop`` of `build_gpt`'s ``model.layers``, with the same values, building no others."""
    factories = gpt_layer_factories(config, tp_group, seed, sequence_parallel=sequence_parallel, cp=cp)
    return [make() for make in factories[start:stop]]


def gpt_loss(config: GPTConfig, tp_group: Group) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`GPT.loss` without the model: mean next-token loss from vocabulary-split logits (a pipeline's last stage)."""
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if _token_losses(logits, targets):  # the tiled head's per-token losses (GPTHead.tiled_loss)
            return logits.mean()
        return vocab_parallel_cross_entropy(logits, targets, tp_group, config.vocab_size).mean()
    return loss


def build_gpt(config: GPTConfig, tp_group: Group, seed: int, *, sequence_parallel: bool = False,
              cp: ContextParallel | None = None) -> GPT:
    """The reference GPT sliced over `tp_group`; equal to the tp=1 model of the same seed, sliced.

    Each parameter draws from its own seed (derived from `seed` and its layer
    index), so the result does not depend on the tp size. Dropout streams are
    seeded from `seed` too (see `TensorParallelRNG`).
    """
    rng = TensorParallelRNG(tp_group, seed)
    factories = gpt_layer_factories(config, tp_group, seed, sequence_parallel=sequence_parallel, rng=rng, cp=cp)
    return GPT(config, [make() for make in factories], tp_group, rng, sequence_parallel)
