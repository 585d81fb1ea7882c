"""Tensor-parallel plans for Hugging Face `transformers` model families, picked by the model's config.

    plan = hf_plan(model, tp=2)          # None for a model that is not a known transformers family
    parallelize(model, plan, groups.tp)

Megatron's split of a transformer block, in each family's own module names:
the attention's query/key/value projections split by heads (column), its
output projection row-parallel; the MLP's up (and gate) projections column,
its down projection row; the token embedding vocabulary-parallel and the LM
head column-parallel with its logits gathered (they stay tied where the model
ties them). Position embeddings and norms stay whole on every rank.

* GPT-2 (``model_type`` "gpt2"): ``c_attn`` is one fused Conv1D of [q; k; v],
  split per head (``column_qkv``; Conv1D's transposed weight is handled by
  `parallelize`), and the attention's ``split_size`` / ``num_heads`` are
  divided, which its forward splits q/k/v by.
* Llama, Mistral, Qwen2 (grouped-query attention): q, k, v are separate
  projections (column each), so the key/value heads must divide by tp too.
  Their forwards take the head count from the tensors' shapes.
* BERT: the self-attention's query/key/value (column), its output dense (row),
  the intermediate dense (column) and the layer output dense (row); the
  masked-LM decoder is gathered.

`transformers` is never imported here: the plan is chosen from
``model.config.model_type`` and module names, so capstan imports without it.
"""

from __future__ import annotations

import re

from torch import nn

from .apply import Divide

__all__ = ["hf_plan", "HF_FAMILIES"]

# Regular expressions over module names (a leading prefix like "transformer." or "model." may come
# first); `hf_plan` expands them into the exact names `parallelize` takes.
_P = r"(?:.*\.)?"
_GPT2 = {
    _P + r"h\.\d+\.attn\.c_attn": "column_qkv", _P + r"h\.\d+\.attn\.c_proj": "row",
    _P + r"h\.\d+\.attn": Divide("split_size", "num_heads"),
    _P + r"h\.\d+\.mlp\.c_fc": "column", _P + r"h\.\d+\.mlp\.c_proj": "row",
    _P + r"wte": "embedding", r"lm_head": "column_gather",
}
_LLAMA = {
    _P + r"layers\.\d+\.self_attn\.[qkv]_proj": "column", _P + r"layers\.\d+\.self_attn\.o_proj": "row",
    _P + r"layers\.\d+\.mlp\.(?:gate|up)_proj": "column", _P + r"layers\.\d+\.mlp\.down_proj": "row",
    _P + r"embed_tokens": "embedding", r"lm_head": "column_gather",
}
_BERT = {
    _P + r"encoder\.layer\.\d+\.attention\.self\.(?:query|key|value)": "column",
    _P + r"encoder\.layer\.\d+\.attention\.output\.dense": "row",
    _P + r"encoder\.layer\.\d+\.attention\.self": Divide("num_attention_heads", "all_head_size"),
    _P + r"encoder\.layer\.\d+\.intermediate\.dense": "column",
    _P + r"encoder\.layer\.\d+\.output\.dense": "row",
    _P + r"embeddings\.word_embeddings": "embedding", _P + r"cls\.predictions\.decoder": "column_gather",
}
HF_FAMILIES = {"gpt2": _GPT2, "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "bert": _BERT}


def _heads(config: object) -> list[tuple[str, int]]:
    heads = [("num_attention_heads", getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None))]
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None:
        heads.append(("num_key_value_heads", kv))
    return [(name, n) for name, n in heads if isinstance(n, int)]


def hf_plan(model: nn.Module, tp: int) -> dict[str, str | Divide] | None:
    """The plan for `model`'s family at tensor-parallel size `tp`, or None if it is not a known
    transformers family. Entries for modules the model does not have (a base model without its LM
    head) are left out; heads that do not divide by tp are a ValueError naming the config attribute."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in HF_FAMILIES:
        return None
    for name, n in _heads(config):
        if n % tp:
            raise ValueError(f"{type(model).__name__}: config.{name} = {n} is not divisible by parallel.tp = {tp} "
                             "(tensor parallelism splits whole attention heads)")
    plan: dict[str, str | Divide] = {}
    for name, _ in model.named_modules():
        for pattern, style in HF_FAMILIES[family].items():
            if name and re.fullmatch(pattern, name):
                plan[name] = style  # an exact name: fnmatch in `parallelize` matches it alone
                break
    return plan
