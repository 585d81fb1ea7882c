"""`parallelize(model, plan, group)`: slice an existing dense nn.Module in place.

A plan maps fnmatch patterns over ``model.named_modules()`` names to a style:

    plan = {
        "*.attn.qkv": "column_qkv",      # fused [q; k; v] nn.Linear, split per head
        "*.attn.proj": "row",
        "*.mlp.fc": "column",
        "*.mlp.proj": "row",
        "wte": "embedding",
        "lm_head": "column_gather",      # full logits on every rank
        "*.attn": Divide("n_head"),      # local head count for the model's own forward
    }
    parallelize(model, plan, groups.tp)

Styles (each replaces the matched module by the parallel layer, sliced from
the module's current weights, so the result computes exactly what it did):

- ``column``: nn.Linear -> ColumnParallelLinear, output stays split [.., out/tp]. Hugging Face's
  Conv1D (GPT-2's linear layers, weight stored [in, out]) is taken wherever nn.Linear is.
- ``column_gather``: the same, output all-gathered to [.., out] (padded if out % tp != 0).
- ``column_qkv``: fused q/k/v nn.Linear [3d, d] split per block, so rank r
  holds [q_r; k_r; v_r], i.e. whole heads. Plain ``column`` on a fused qkv
  would hand rank 0 all of q and part of k: wrong. Needs n_heads % tp == 0.
- ``row``: nn.Linear -> RowParallelLinear whose input is already split.
- ``row_scatter``: the same, but the input is full and split here.
- ``embedding``: nn.Embedding -> VocabParallelEmbedding (vocabulary padded as needed).
- ``Divide("attr", ...)``: divide integer attributes of the matched module by tp
  (e.g. the head count the model's own forward uses), checking divisibility.

Constraint on the model's code: its forward must derive local sizes from
attributes the plan divides or from tensor shapes (``view(b, s, -1, head_dim)``),
never from a hard-coded full width. Tied parameters (one nn.Parameter in two
modules, e.g. wte and lm_head) stay tied when both sides split it the same way.
Sequence parallelism is not offered here: it needs the norms and dropouts of
the model rewritten (use the layers in `blocks` / `gpt`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from capstan.comm import Group

from ..modules.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..slicing.partition import divide

__all__ = ["parallelize", "Divide", "STYLES"]

STYLES = ("column", "column_gather", "column_qkv", "row", "row_scatter", "embedding")


@dataclass(frozen=True)
class Divide:
    """Plan entry: divide these integer attributes of the matched module by the tp size."""

    attrs: tuple[str, ...]

    def __init__(self, *attrs: str) -> None:
        object.__setattr__(self, "attrs", attrs)


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer whose weight is stored transposed, [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _convert(name: str, module: nn.Module, style: str, group: Group) -> nn.Module:
    kind = nn.Embedding if style == "embedding" else nn.Linear
    conv = style != "embedding" and _is_conv1d(module)
    if not isinstance(module, kind) and not conv:
        raise TypeError(f"plan style {style!r} needs an nn.{kind.__name__} but module {name!r} is "
                        f"{type(module).__name__}")
    w = module.weight.detach()
    if conv:  # y = x @ W + b with W [in, out]: the same as nn.Linear with W^T
        w = w.t().contiguous()
    common = dict(dtype=w.dtype, device=w.device, full_weight=w)
    if style == "embedding":
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, group, **common)
    out_features, in_features = w.shape
    has_bias = module.bias is not None
    b = module.bias.detach() if has_bias else None
    if style.startswith("column"):
        return ColumnParallelLinear(in_features, out_features, group, bias=has_bias, full_bias=b,
                                    gather_output=style == "column_gather", pad_output=style == "column_gather",
                                    fused=3 if style == "column_qkv" else 1, **common)
    return RowParallelLinear(in_features, out_features, group, bias=has_bias, full_bias=b,
                             input_is_parallel=style == "row", **common)


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def parallelize(model: nn.Module, plan: dict[str, str | Divide], group: Group) -> nn.Module:
    """Replace the modules of `model` that `plan` names by tensor-parallel ones; returns `model`.

    Every pattern must match at least one module (a typo is an error, not a
    silent no-op) and a module may match only one pattern. On a group of one
    the model is converted too (identical numbers, no communication).
    """
    names = [n for n, _ in model.named_modules() if n]
    matches: dict[str, tuple[str, str | Divide]] = {}
    for pattern, style in plan.items():
        if not isinstance(style, Divide) and style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r}: unknown style; expected one of "
                             f"{', '.join(STYLES)} or Divide(...)")
        hit = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hit:
            raise ValueError(f"plan pattern {pattern!r} matches no module of {type(model).__name__}")
        for n in hit:
            if n in matches:
                raise ValueError(f"module {n!r} matches both {matches[n][0]!r} and {pattern!r}")
            matches[n] = (pattern, style)

    # Tied weights: remember the sliced parameter per (original parameter, way of slicing).
    sliced: dict[tuple[int, str], nn.Parameter] = {}
    for name, (_, style) in matches.items():
        module = model.get_submodule(name)
        if isinstance(style, Divide):
            for attr in style.attrs:
                value = getattr(module, attr, None)
                if not isinstance(value, int):
                    raise TypeError(f"Divide({attr!r}) on {name!r}: attribute is {type(value).__name__}, not int")
                setattr(module, attr, divide(value, group, f"{name}.{attr}"))
            continue
        original = module.weight
        new = _convert(name, module, style, group)
        # Embedding rows and padded column rows split [vocab, d] identically.
        how = "rows" if style in ("embedding", "column", "column_gather") else style
        key = (id(original), how)
        if key in sliced:
            new.weight = sliced[key]
        else:
            sliced[key] = new.weight
        for pname, p in new.named_parameters(recurse=False):  # keep frozen parameters frozen
            p.requires_grad_(getattr(module, pname).requires_grad)
        new.train(module.training)
        _set_child(model, name, new)
    return model
