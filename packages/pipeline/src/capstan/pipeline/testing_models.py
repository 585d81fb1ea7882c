"""A small self-contained GPT as a list of `LayerSpec`s, for tests, examples and benchmarks.

Layers: `Embedding` (token + position), `Block` x N (pre-norm causal
self-attention + MLP), `Head` (final norm + vocabulary projection). With
``tied=True`` the head's projection shares the embedding's token weight (key
"embed"), the classic GPT-2 tying that puts one weight on the first and the
last pipeline stage. `gpt_loss` is the mean token cross-entropy.

Kept inside capstan.pipeline on purpose: the pipeline must not depend on
capstan.tensorpar's reference model.

Example::

    import torch
    from capstan.pipeline.testing_models import gpt_specs, gpt_loss
    from capstan.pipeline.stages.partition import build_layers
    specs = gpt_specs(vocab=128, hidden=32, layers=2, heads=4, seq=16)
    model = torch.nn.Sequential(*build_layers(specs, range(len(specs)), seed=0))
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .stages.partition import LayerSpec

__all__ = ["Embedding", "Block", "Head", "gpt_specs", "gpt_loss"]


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.randn(vocab, hidden) * 0.02
        )  # [vocab, hidden], tied with Head
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [b, t] int64 -> [b, t, hidden]
        return F.embedding(ids, self.weight) + self.pos[: ids.shape[1]]


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, t, h] -> [b, t, h]
        b, t, h = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, t, h/heads]
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * 0.02)  # [vocab, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, t, h] -> logits [b, t, vocab]
        return F.linear(self.ln(x), self.weight)


def gpt_specs(
    vocab: int = 256,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    seq: int = 32,
    tied: bool = False,
) -> list[LayerSpec]:
    """Embedding, `layers` blocks, head; `tied` shares the token weight of embedding and head."""
    key = "embed" if tied else None
    return (
        [LayerSpec(partial(Embedding, vocab, hidden, seq), "embed", tied=key)]
        + [LayerSpec(partial(Block, hidden, heads), f"block{i}") for i in range(layers)]
        + [LayerSpec(partial(Head, vocab, hidden), "head", tied=key)]
    )


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits [b, t, vocab], targets [b, t] int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
