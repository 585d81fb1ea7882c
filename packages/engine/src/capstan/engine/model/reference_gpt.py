"""The reference GPT's arithmetic, once: parameters and forward FLOPs of each of its layers.

capstan's reference GPT (capstan.tensorpar.build_gpt) is laid out as [embedding, block x n_layers,
final norm, head] for the pipeline's partition, the planner and the config's budget checks. Those
counts were written three times (config/load.py, plan/spec.py, tools/bench_chunkmem.py); they live here,
torch-free, so the config check of a bad budget stays fast and every caller agrees with the others.
`tests/test_plan.py` checks them against the parameters `build_gpt` really makes.
"""

from __future__ import annotations

__all__ = ["layer_params", "layer_flops", "param_count"]


def layer_params(layers: int, hidden: int, vocab: int, seq: int, ffn_mult: int = 4, tp: int = 1) -> list[int]:
    """Parameters of each layer on one rank of a tensor-parallel group of `tp`: matrices and column biases
    sliced, norms and row biases not, the vocabulary padded to a multiple of tp (VocabParallelEmbedding)."""
    h, f = hidden, ffn_mult * hidden
    padded = -(-vocab // tp) * tp
    # attention qkv (3h^2 + 3h) and output (h^2 + h), MLP fc (h f + f) and proj (f h + h): the row biases
    # (h each) are whole on every rank, so they stand outside the division with the two norms (2 x 2h)
    block = (3 * h * h + 3 * h + h * h + h * f + f + f * h) // tp + 4 * h + 2 * h
    return [padded * h // tp + seq * h, *([block] * layers), 2 * h, padded * h // tp]


def param_count(layers: int, hidden: int, vocab: int, seq: int, ffn_mult: int = 4) -> int:
    """All of the reference GPT's parameters (tp = 1)."""
    return sum(layer_params(layers, hidden, vocab, seq, ffn_mult))


def layer_flops(layers: int, hidden: int, vocab: int, seq: int) -> list[int]:
    """Forward FLOPs per token of each layer at tp = 1: a block's matmuls (qkv 6h^2, output 2h^2, MLP
    16h^2) and attention (QK^T and AV, 2 seq h each), the head's 2 h vocab; embedding and norms 0."""
    return [0, *([24 * hidden * hidden + 4 * seq * hidden] * layers), 0, 2 * hidden * vocab]
