"""A Hugging Face transformers model as a list of pipeline layers, with no adapter code from the user.

    specs = hf_layer_specs(model)        # None for a model that is not of a known family
    partition(specs, parts=4, method="parameters")

The layers are [embedding, layer 0 ... n-1, final norm + LM head], each a
thin module around the model's own submodules (the same parameter objects,
so nothing is copied and a checkpoint holds the model's values):

* GPT-2: token + position embeddings (and their dropout); each `GPT2Block`;
  `ln_f` and `lm_head`;
* Llama, Mistral, Qwen2: the token embedding; each decoder layer, which gets
  its rotary position embeddings from the model's own `rotary_emb` (they are
  computed per layer from the sequence length: buffers, no parameters); the
  final norm and `lm_head`;
* BERT (`BertForMaskedLM`): the embeddings (word, position, token type,
  LayerNorm); each encoder `BertLayer`, bidirectional (no mask: the whole
  sequence attends to itself, as the unsplit model does without padding);
  the masked-LM head (`cls`: transform + decoder tied to the word embedding).

Between stages only the hidden states travel. The causal mask is left to
the attention kernel (``is_causal``, as `transformers` itself does for the
"sdpa" and flash implementations); for the "eager" implementation an
explicit additive causal mask is passed for decoders. A head tied to the
embedding (GPT-2, BERT, or ``tie_word_embeddings``) is tied across stages
through `LayerSpec.tied`; `HF_TIED_HEADS` names the pair in the model.
`transformers` is never imported here: the model is read by its structure.
"""

from __future__ import annotations

import torch
from torch import nn

from .partition import LayerSpec

__all__ = ["hf_layer_specs", "hf_param_name", "HF_PIPELINE_FAMILIES", "HF_TIED_HEADS"]

HF_PIPELINE_FAMILIES = ("bert", "gpt2", "llama", "mistral", "qwen2")

_LLAMA_TIED = ("lm_head.weight", "model.embed_tokens.weight")
HF_TIED_HEADS = {"gpt2": ("lm_head.weight", "transformer.wte.weight"), "llama": _LLAMA_TIED,
                 "mistral": _LLAMA_TIED, "qwen2": _LLAMA_TIED,
                 "bert": ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")}
"""family -> (the head's weight, the embedding it is tied to), as the transformers model names them."""


def _first(out: object) -> torch.Tensor:
    """A decoder layer's hidden states (older transformers return a tuple)."""
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


def _causal_mask(config: object, h: torch.Tensor) -> torch.Tensor | None:
    if getattr(config, "_attn_implementation", "sdpa") != "eager":
        return None  # the kernel's is_causal, as transformers does without padding
    t = h.shape[1]
    mask = torch.full((t, t), torch.finfo(h.dtype).min, device=h.device, dtype=h.dtype).triu(1)
    return mask[None, None]


class GPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop
        self.weight = wte.weight  # the same parameter, named for `LayerSpec.tied_attr` (tied with the head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(pos)[None])


class DecoderLayer(nn.Module):
    """One decoder layer of the model; `rotary` (Llama family) gives its position embeddings."""

    def __init__(self, layer: nn.Module, config: object, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.layer, self.config = layer, config
        self.rotary = rotary  # the model's one rotary module, shared by every layer (buffers, no parameters)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = _causal_mask(self.config, h)
        if self.rotary is None:
            return _first(self.layer(h, attention_mask=mask))
        position_ids = torch.arange(h.shape[1], device=h.device)[None]
        cos_sin = self.rotary(h, position_ids=position_ids)
        return _first(self.layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin))


class EncoderLayer(nn.Module):
    """One bidirectional encoder layer (BERT): no attention mask, as the unsplit model without padding."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _first(self.layer(h))


class BertEmbedding(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.weight = embeddings.word_embeddings.weight  # named for `LayerSpec.tied_attr`

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids=ids)


class MaskedLMHead(nn.Module):
    """BERT's `cls` head (transform, then the decoder tied to the word embedding, and its bias)."""

    def __init__(self, cls: nn.Module) -> None:
        super().__init__()
        self.cls = cls
        self.weight = cls.predictions.decoder.weight  # named for `LayerSpec.tied_attr`

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.cls(h)


class Embedding(nn.Module):
    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed
        self.weight = embed.weight  # named for `LayerSpec.tied_attr` where the head is tied to it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class Head(nn.Module):
    """The final norm and the LM head (a tensor-parallel one after `parallelize`: its own forward)."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head
        self.weight = head.weight  # named for `LayerSpec.tied_attr`

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


def _bert_param_name(i: int, rest: str, n_layers: int) -> str:
    if i == 0:
        return "bert.embeddings.word_embeddings.weight" if rest == "weight" else f"bert.{rest}"
    if i == n_layers + 1:
        if rest in ("weight", "cls.predictions.decoder.weight"):
            return "cls.predictions.decoder.weight"
        return "cls.predictions.bias" if rest == "cls.predictions.decoder.bias" else rest
    return f"bert.encoder.layer.{i - 1}.{rest[len('layer.'):]}"


def hf_param_name(name: str, model_type: str, n_layers: int) -> str:
    """A parameter's name in the split model (``<layer>.<name inside the layer module>``, as capstan's
    checkpoints of a pipeline name it) -> its name in the transformers model."""
    index, _, rest = name.partition(".")
    i = int(index)
    if 0 < i <= n_layers and not rest.startswith("layer."):
        raise ValueError(f"unexpected parameter {name!r} in layer {i - 1} of a split {model_type} model")
    if model_type == "bert":
        return _bert_param_name(i, rest, n_layers)
    gpt2 = model_type == "gpt2"
    if i == 0:  # the embedding: `weight` is the token embedding's (also reachable as wte / embed)
        if rest in ("weight", "wte.weight", "embed.weight"):
            return "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"
        return f"transformer.{rest}" if gpt2 else f"model.{rest}"
    if i == n_layers + 1:  # the final norm and the head
        if rest in ("weight", "head.weight"):
            return "lm_head.weight"
        if rest == "head.bias":
            return "lm_head.bias"
        if rest.startswith("norm."):
            return ("transformer.ln_f." if gpt2 else "model.norm.") + rest[len("norm."):]
        raise ValueError(f"unexpected parameter {name!r} in the head of a split {model_type} model")
    return (f"transformer.h.{i - 1}." if gpt2 else f"model.layers.{i - 1}.") + rest[len("layer."):]


def hf_layer_specs(model: nn.Module) -> list[LayerSpec] | None:
    """The model as pipeline layers (see the module docstring), or None if it is not of a known family
    (or not its language-model class: a BERT without the masked-LM head has no logits to train)."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family == "bert" and hasattr(model, "cls") and hasattr(getattr(model, "bert", None), "encoder"):
        body = model.bert
        first = BertEmbedding(body.embeddings)
        blocks = [EncoderLayer(layer) for layer in body.encoder.layer]
        last = MaskedLMHead(model.cls)
        tied = model.cls.predictions.decoder.weight is body.embeddings.word_embeddings.weight
        return _specs(first, blocks, last, tied)
    if family not in HF_PIPELINE_FAMILIES or family == "bert" or not hasattr(model, "lm_head"):
        return None
    head = model.lm_head
    if family == "gpt2":
        body = model.transformer
        first = GPT2Embedding(body.wte, body.wpe, body.drop)
        blocks = [DecoderLayer(block, config) for block in body.h]
        last = Head(body.ln_f, head)
        tied = head.weight is body.wte.weight
    else:
        body = model.model
        first = Embedding(body.embed_tokens)
        blocks = [DecoderLayer(layer, config, body.rotary_emb) for layer in body.layers]
        last = Head(body.norm, head)
        tied = head.weight is body.embed_tokens.weight
    return _specs(first, blocks, last, tied)


def _specs(first: nn.Module, blocks: list[nn.Module], last: nn.Module, tied: bool) -> list[LayerSpec]:
    key = "embedding" if tied else None
    layers = [first, *blocks, last]
    names = ["embedding", *(f"layer{i}" for i in range(len(blocks))), "head"]
    return [LayerSpec(lambda m=m: m, name, tied=key if i in (0, len(layers) - 1) else None)
            for i, (m, name) in enumerate(zip(layers, names))]
