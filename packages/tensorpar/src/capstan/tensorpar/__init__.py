"""capstan.tensorpar: Megatron-style tensor slicing on an explicit tp `Group`.

Layers (`modules.layers`, `modules.blocks`), the autograd collectives they are
made of (`slicing.mappings`), vocabulary-parallel cross-entropy
(`modules.cross_entropy`), dropout streams (`slicing.rng`), `parallelize` for
existing dense models (`convert.apply`) and a
reference GPT (`gpt`). See docs/tensorpar.md.

Example (one process; under torchrun use ``comm.build_groups(...).tp``)::

    import torch
    from capstan import comm
    from capstan.tensorpar import GPTConfig, build_gpt

    tp = comm.single_process_groups().tp
    model = build_gpt(GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2, dropout=0.0), tp, seed=0)
    ids = torch.randint(0, 64, (2, 8))
    model.loss(model(ids), ids).backward()
"""

from .convert.apply import STYLES, Divide, parallelize
from .convert.hf_plans import HF_FAMILIES, hf_plan
from .modules.blocks import ParallelBlock, ParallelMLP, ParallelSelfAttention, check_attention_sizes
from .modules.cross_entropy import gather_vocab_logits, vocab_parallel_cross_entropy
from .modules.gpt import (
                  GPT,
                  GPTConfig,
                  GPTEmbedding,
                  GPTFinalNorm,
                  GPTHead,
                  build_gpt,
                  build_gpt_layers,
                  gpt_layer_factories,
                  gpt_loss,
)
from .modules.layers import (
                  ColumnParallelLinear,
                  ParallelLayerNorm,
                  ParallelRMSNorm,
                  RowParallelLinear,
                  VocabParallelEmbedding,
)
from .recompute import is_recomputed, recompute
from .slicing.mappings import (
                  CommCounter,
                  copy_to_tensor_parallel_region,
                  count_comm,
                  gather_from_sequence_parallel_region,
                  gather_from_tensor_parallel_region,
                  reduce_from_tensor_parallel_region,
                  reduce_scatter_to_sequence_parallel_region,
                  scatter_to_sequence_parallel_region,
                  scatter_to_tensor_parallel_region,
)
from .slicing.partition import divide, tp_dim_of
from .slicing.rng import TensorParallelRNG, dropout

__all__ = [
    "is_recomputed", "recompute",
    "HF_FAMILIES", "STYLES", "ColumnParallelLinear", "CommCounter", "Divide", "GPT", "GPTConfig", "GPTEmbedding",
    "GPTFinalNorm", "GPTHead", "hf_plan", "ParallelBlock", "ParallelLayerNorm", "ParallelMLP", "ParallelRMSNorm",
    "ParallelSelfAttention",
    "RowParallelLinear", "TensorParallelRNG", "VocabParallelEmbedding", "build_gpt", "build_gpt_layers",
    "check_attention_sizes", "gpt_layer_factories", "gpt_loss",
    "copy_to_tensor_parallel_region", "count_comm", "divide", "dropout", "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region", "gather_vocab_logits", "parallelize",
    "reduce_from_tensor_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_parallel_region", "tp_dim_of",
    "vocab_parallel_cross_entropy",
]
