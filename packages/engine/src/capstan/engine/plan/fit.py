"""Layer costs of a shape nobody profiled, fitted to the shapes that were.

A calibration profiles the layers of the shapes it is given (costs.measure_layers). A plan for any other
shape used to fall back to FLOPs at the machine's matmul rate, which is the cost of the matmuls alone: a
small layer also pays element-wise passes, attention's scores and per-op overheads that no FLOP count
holds (the planner issue's example: calibrated on 3 x 192, a 6 x 320 model was predicted 22% fast). Here
each layer kind's profiles of one family (the same precision, threads, ranks busy, ffn multiple and
flags; other hidden, head, vocabulary, sequence, micro-batch and tensor-parallel sizes: a tp rank's work
is its share of the terms below) fit a cost per unit of work:

    block:   t = x1 * matmul FLOPs + x2 * element-wise values (tokens x hidden) + x3 * attention scores
    head:    t = x1 * matmul FLOPs + x2 * logits (tokens x vocabulary)
    embed, norm:  t = x1 * tokens x hidden

forward and backward each, by least squares with non-negative coefficients (a term whose coefficient
would go negative is dropped and the rest refit). With fewer profiles than terms the terms are dropped
from the last until the fit is determined, down to one profile scaled by its matmul FLOPs. The work
terms are the same ones `_from_flops` counts, so a fitted cost degrades to the FLOPs estimate where only
the matmul term survives.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .rates import LayerCost

__all__ = ["ProfileKey", "parse_key", "work_terms", "fitted_cost"]

_FLAGS = ("sp", "drop")


@dataclass(frozen=True)
class ProfileKey:
    """A `costs.layer_key` read back: the sizes a fit varies, and the family it must match."""

    kind: str
    hidden: int
    heads: int
    vocab: int
    seq: int
    micro: int
    tp: int
    family: tuple  # (kind, precision, ffn_mult, threads, busy, flags, cp, mlp_tile)


@lru_cache(maxsize=4096)  # a search fits every layout it times against the same profile names
def parse_key(key: str) -> ProfileKey | None:
    """The parts of a profile name (costs.layer_key), or None for a name of another form."""
    parts = key.split(".")
    kind, rest = parts[0], parts[1:]
    values: dict[str, int] = {}
    flags, precision, cp, tile, busy = [], None, "", 0, 1
    for p in rest:
        if p in _FLAGS:
            flags.append(p)
        elif p in ("fp32", "bf16", "fp16"):
            precision = p
        elif p.startswith("busy") and p[4:].isdigit():
            busy = int(p[4:])
        elif p.startswith("tp") and p[2:].isdigit():
            values["tp"] = int(p[2:])
        elif p.startswith("mt") and p[2:].isdigit():
            tile = int(p[2:])
        elif p.startswith("cp"):
            cp = p
        elif p[:1] in "havsfbt" and p[1:].isdigit():
            values[p[0]] = int(p[1:])
        else:
            return None
    if precision is None or not {"h", "a", "v", "s", "f", "tp", "b", "t"} <= values.keys():
        return None
    family = (kind, precision, values["f"], values["t"], busy, tuple(flags), cp, tile)
    return ProfileKey(kind, values["h"], values["a"], values["v"], values["s"], values["b"], values["tp"], family)


def work_terms(kind: str, hidden: int, heads: int, vocab: int, seq: int, micro: int, ffn_mult: int, tp: int,
               cp: int) -> list[float]:
    """The units of work of one layer on one rank, in the order of the module docstring's formula."""
    tokens = micro * seq / cp
    if kind == "block":
        flops = (2 * tokens * hidden * hidden * (4 + 2 * ffn_mult) + 4 * micro * seq * seq * hidden / cp) / tp
        return [flops, tokens * hidden, micro * heads / tp * seq * seq / cp]
    if kind == "head":
        return [2 * tokens * hidden * vocab / tp, tokens * vocab / tp]
    return [tokens * hidden]


def _terms(k: ProfileKey) -> list[float]:
    _, _, ffn, _, _, _, cp, _ = k.family
    cp_n = int(cp[2:-1]) if cp else 1
    return work_terms(k.kind, k.hidden, k.heads, k.vocab, k.seq, k.micro, ffn, k.tp, cp_n)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 for a handful of terms: drop a negative one, refit, until none is."""
    keep = list(range(a.shape[1]))
    while keep:
        x, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (x >= 0).all():
            out = np.zeros(a.shape[1])
            out[keep] = x
            return out
        keep.pop(int(np.argmin(x)))
    return np.zeros(a.shape[1])


def fitted_cost(target: ProfileKey, profiles: dict[str, LayerCost]) -> LayerCost | None:
    """The cost of `target` fitted to the profiles of its family (module docstring), or None when the
    family has none."""
    rows = [(k, c) for k, c in ((parse_key(name), cost) for name, cost in profiles.items())
            if k is not None and k.family == target.family]
    if not rows:
        return None
    a = np.array([_terms(k) for k, _ in rows], dtype=np.float64)
    n = min(a.shape[1], len(rows))  # no more terms than profiles: the first n (matmuls first)
    a = a[:, :n]
    scale = a.max(axis=0)  # the terms span many orders of magnitude: fit in units of their largest value
    scale[scale == 0] = 1.0
    want = np.array(_terms(target)[:n], dtype=np.float64) / scale
    out = []
    for part in ("forward", "backward"):
        b = np.array([getattr(c, part) for _, c in rows], dtype=np.float64)
        out.append(float(want @ _nnls(a / scale, b)))
    return LayerCost(*out)
