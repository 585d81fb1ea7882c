"""What one rank's training state is, in layout-independent terms: for universal checkpoints.

Every parameter is known by its *canonical name*: its name in the one-process
model (``layers.3.attn.qkv.weight`` for the reference GPT; a pipeline stage's
``<chunk>.<global layer>.…`` names map back to ``layers.<global layer>.…``).
For each one this rank holds a *local tensor*: the whole parameter, or its
tensor-parallel slice (``param.tp_dim``, with ``tp_fused`` separately split
blocks, e.g. q/k/v, and zero padding rows of a padded vocabulary). Of the
local tensor's flat elements, this rank *owns* a range for the checkpoint:

* replicated parameters (``tp_dim is None``) are written by tp rank 0 only;
* ZeRO 0 (every dp rank holds everything): dp rank 0 writes;
* ZeRO 1/2: the intersection of the parameter with this rank's flat shard;
* chunks (ZeRO-3 / offload): the parameters of the chunks this rank owns.

`merge_tp` and `slice_tp` convert between local slices and the full
(logical, unpadded) tensor, so state written under one (dp, tp, pp, ZeRO,
offload) can be read under any other.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: the engine imports this package (Engine.save / load)
    from ..engine import Engine

__all__ = ["LocalParam", "StateView", "state_view", "merge_tp", "slice_tp", "FIELDS", "rng_generators",
           "describe_param", "param_owners", "tied_alias", "canonical_name"]

FIELDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class LocalParam:
    """One parameter as this rank holds it."""

    name: str  # canonical
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]  # logical, unpadded, unsliced
    tp_dim: int | None
    tp_fused: int
    tp_rank: int
    tp_size: int
    own: tuple[int, int]  # flat range of the local tensor this rank writes (empty: start == end)
    alias: str | None = None  # another name holding the same values (a head tied to the embedding)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def describe(self) -> dict[str, object]:
        return {"shape": list(self.full_shape), "tp_dim": self.tp_dim, "tp_fused": self.tp_fused}


def _logical_rows(module: nn.Module) -> int | None:
    """The unpadded size of a vocabulary-padded layer's dim 0 (tensorpar's padded embedding and head)."""
    if hasattr(module, "num_embeddings_padded"):
        return int(module.num_embeddings)  # type: ignore[arg-type]
    if getattr(module, "out_features_padded", None) not in (None, getattr(module, "out_features", None)):
        return int(module.out_features)  # type: ignore[arg-type]
    return None


def describe_param(name: str, p: nn.Parameter, shape: tuple[int, ...], owner: nn.Module, tp_rank: int,
              tp_size: int) -> LocalParam:
    tp_dim = getattr(p, "tp_dim", None)
    fused = int(getattr(p, "tp_fused", 1) or 1)
    full = list(shape)
    if tp_dim is not None:
        full[tp_dim] *= tp_size
        rows = _logical_rows(owner)
        if tp_dim == 0 and rows is not None:
            full[0] = rows
    return LocalParam(name, tuple(shape), tuple(full), tp_dim, fused, tp_rank, tp_size, (0, 0))


def canonical(name: str, pipelined: bool, prefix: str = "layers.") -> str:
    """A stage module's name ``<chunk>.<global layer>.rest`` -> ``<prefix><global layer>.rest``: the
    name in the one-process model (the reference GPT's ``layers.``, a user nn.Sequential's ``""``)."""
    if pipelined:
        m = re.match(r"^(?:module\.)?\d+\.(\d+)\.(.*)$", name)
        if m is None:
            raise ValueError(f"pipeline stage parameter {name!r} is not named <chunk>.<layer>.<name>")
        return f"{prefix}{m.group(1)}.{m.group(2)}"
    return name


def _prefix(engine: Engine) -> str:
    return "layers." if engine.pipeline is None or engine.pipeline.reference else ""


def canonical_name(engine: Engine, local_name: str) -> str:
    """A parameter's layout-free name: `canonical`, and for a transformers decoder split into pipeline
    layers its name in the transformers model (capstan.pipeline.hf_param_name), so its checkpoints
    load under any layout and export under the model's own names."""
    name = canonical(local_name, engine.pipeline is not None, _prefix(engine))
    hf = engine.hf_source
    if hf and engine.pipeline is not None:
        from capstan.pipeline import hf_param_name

        return hf_param_name(name, hf["model_type"], hf["n_layers"])
    return name


def tied_alias(engine: Engine, name: str) -> str | None:
    """A transformers head tied to its embedding: a checkpoint from one process has only the embedding
    (the model lists a tied parameter once), so the head's stage loads from it."""
    from capstan.pipeline import HF_TIED_HEADS

    hf = engine.hf_source
    head, embedding = HF_TIED_HEADS.get(hf["model_type"] if hf else None, (None, None))
    if name != head or not hf["config"].get("tie_word_embeddings", True):
        return None
    return embedding


def param_owners(module: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """id(param) -> (its name in `module`, the module that holds it directly)."""
    out: dict[int, tuple[str, nn.Module]] = {}
    for mod_name, mod in module.named_modules():
        for attr, p in mod.named_parameters(recurse=False):
            out.setdefault(id(p), (f"{mod_name}.{attr}" if mod_name else attr, mod))
    return out


class StateView:
    """Reads and writes this rank's part of every parameter's state (see the module docstring)."""

    params: list[LocalParam]

    def read(self, lp: LocalParam, field: str) -> torch.Tensor:
        """Flat elements ``lp.own`` of `field` of the local tensor, in `dtype(field)`."""
        raise NotImplementedError

    def dtype(self, field: str) -> torch.dtype:
        """What `field` is kept (and saved) as: fp32, but Adam's moments under precision.optimizer_states =
        "bf16" and the parameter under precision.master_weights = "bf16", which checkpoints hold as they are
        (a load converts to what the loading run keeps)."""
        return torch.float32

    def write(self, lp: LocalParam, field: str, local: torch.Tensor) -> None:
        """Set `field` from the whole local tensor (this rank keeps the part it holds)."""
        raise NotImplementedError

    def finish_load(self) -> None:
        """Called after every `write` and after `optimizer_step` is set."""

    def local_keys(self) -> dict[str, int]:
        """This rank's own state outside the parameters' (1-bit Adam's error-feedback residuals): key ->
        fp32 elements. Saved in its file and restored under the same layout only."""
        return {}

    def read_local(self, key: str) -> torch.Tensor:
        """A copy in RAM of local state `key` (`local_keys`)."""
        raise KeyError(key)

    def write_local(self, key: str, value: torch.Tensor) -> None:
        """Set local state `key` from `value` (as many elements as `local_keys` says)."""
        raise KeyError(key)

    optimizer_step: int


def state_view(engine: Engine) -> StateView:
    """This rank's training state as checkpoints read and write it: the model states' own view of
    themselves (engine/states: FlatView for flat buffers, ChunkView for chunks)."""
    return engine.states.checkpoint_view(engine)


def _blocks(t: torch.Tensor, dim: int, fused: int) -> list[torch.Tensor]:
    return list(t.chunk(fused, dim)) if fused > 1 else [t]


def merge_tp(slices: list[torch.Tensor], tp_dim: int | None, fused: int, full_shape: tuple[int, ...]) -> torch.Tensor:
    """The full logical tensor from the local slices of tp ranks 0..n-1 (padding rows dropped)."""
    if tp_dim is None:
        return slices[0]
    per_rank = [_blocks(s, tp_dim, fused) for s in slices]
    blocks = [torch.cat([parts[b] for parts in per_rank], tp_dim) for b in range(fused)]
    full = torch.cat(blocks, tp_dim) if fused > 1 else blocks[0]
    return full.narrow(tp_dim, 0, full_shape[tp_dim]).contiguous()


def slice_tp(full: torch.Tensor, lp: LocalParam) -> torch.Tensor:
    """This rank's local slice of the full logical tensor (zero rows appended up to the padded size)."""
    if lp.tp_dim is None:
        return full
    d, fused = lp.tp_dim, lp.tp_fused
    padded = lp.local_shape[d] * lp.tp_size
    if full.shape[d] < padded:
        pad_shape = list(full.shape)
        pad_shape[d] = padded - full.shape[d]
        full = torch.cat([full, torch.zeros(pad_shape, dtype=full.dtype)], d)
    per = lp.local_shape[d] // fused
    parts = [b.narrow(d, lp.tp_rank * per, per) for b in _blocks(full, d, fused)]
    return torch.cat(parts, d).contiguous() if fused > 1 else parts[0].contiguous()


def rng_generators(engine: Engine) -> Iterator[tuple[str, torch.Generator]]:
    """The dropout generators of tensorpar's layers (replicated and per-tp-rank streams), by key: those
    of the device the model computes on (a GPU draws its masks from CUDA generators)."""
    seen: list[int] = []
    device = engine.device
    suffix = "" if device.type == "cpu" else f".{device.type}"
    for mod in engine.states.raw_module().modules():
        rng = getattr(mod, "rng", None)
        if rng is None or not hasattr(rng, "tensor_parallel") or id(rng) in seen:
            continue
        seen.append(id(rng))
        yield f"rng.tp{len(seen) - 1}.replicated{suffix}", rng.replicated(device)
        yield f"rng.tp{len(seen) - 1}.tensor_parallel{suffix}", rng.tensor_parallel(device)
