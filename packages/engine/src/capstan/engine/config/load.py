"""The one strict loader of `Config`: TOML, JSON, a dict or a Config, plus ``--set`` overrides.

Every problem is a `ConfigError` whose message names the key path (and, for
an unknown key, the nearest valid one), so the command line can print it as
one line. Checks happen in three layers, all before any process group:

1. structure and types of every value, ranges and choices (`constraint` metadata);
2. cross-field rules that need no processes (sizes divide, budgets, unsupported combinations);
3. `check_world`: dp * tp * pp against the launcher's world size, naming where each number came from.

Example::

    cfg, sources = resolve("examples/tiny.toml", ["train.steps=10"])
    dp = check_world(cfg, comm.detect_launch(), sources)
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from .schema import MOMENT_BYTES, SECTIONS, Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["ConfigError", "load_config", "resolve", "check_world", "parse_override", "to_toml", "Sources"]

Sources = dict[str, str]  # "train.lr" -> "examples/tiny.toml" | "--set train.lr=0.1" | "default"


class ConfigError(ValueError):
    """A configuration (file, dict or override) is invalid; the message says which key and why."""


def _nearest(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(options))}"


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_bytes()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            data = tomllib.loads(text.decode("utf-8"))
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise ConfigError(f"config file {path} is not valid {kind}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is a TOML literal, else a bare string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    path, raw = text.split("=", 1)
    parts = path.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: the key must be section.key, got {path.strip()!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # an unquoted path or word: `--set data.source=notes.txt`
    return parts[0], parts[1], value


def _type_name(annotation: str) -> str:
    return annotation.replace(" | None", "")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int | None:
    """Bytes from "4GiB", "512 MiB", "1.5GB", "4096" (None if `text` is not a size)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if m is None:
        return None
    return int(round(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]))


def check_value(section: str, f: Any, value: Any) -> Any:
    """Check one value against its field's type and constraints; return it (ints widened to float,
    sizes with a unit turned into bytes)."""
    key = f"{section}.{f.name}"
    meta = f.metadata or {}
    if value is None:
        if meta.get("nullable"):
            return None
        raise ConfigError(f"{key} must not be null")
    if meta.get("size") and isinstance(value, str):
        size = parse_size(value)
        if size is None:
            raise ConfigError(f"{key} = {value!r} is not a size: give bytes (4294967296) or a number with a unit "
                              "(512MiB, 4GiB, 1.5GB)")
        value = size
    want = _type_name(f.type)
    if want == "bool":
        ok = isinstance(value, bool)
    elif want == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif want == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"{key} must be {want}, got {type(value).__name__} {value!r}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(repr, choices))}"
                          + _nearest(str(value), [str(c) for c in choices]).replace("valid keys", "choices"))
    for bound, test, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                              ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        b = meta.get(bound)
        if b is not None and not test(value, b):
            raise ConfigError(f"{key} = {value!r} must be {word} {b}")
    if want == "str" and not value:
        raise ConfigError(f"{key} must not be empty")
    return value


def _build(data: Mapping[str, Any], origin: str, base: Config, sources: Sources) -> Config:
    sections = {}
    for name, body in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}] in {origin}" + _nearest(name, list(SECTIONS)))
        if not isinstance(body, Mapping):
            raise ConfigError(f"[{name}] in {origin} must be a table, got {type(body).__name__} {body!r}")
        cls = SECTIONS[name]
        known = {f.name: f for f in fields(cls)}
        values = {}
        for key, value in body.items():
            if key not in known:
                paths = [f"{name}.{k}" for k in known]
                raise ConfigError(f"unknown key '{name}.{key}' in {origin}" + _nearest(f"{name}.{key}", paths))
            values[key] = check_value(name, known[key], value)
            sources[f"{name}.{key}"] = origin
        sections[name] = replace(getattr(base, name), **values)
    return replace(base, **sections)


def resolve(source: str | Path | Mapping[str, Any] | Config | None = None,
            overrides: Sequence[str] = (), reference_model: bool = True,
            layers: Sequence[tuple[Mapping[str, Any], str]] = ()) -> tuple[Config, Sources]:
    """Load, apply ``--set`` overrides, and check; returns the config and where each key came from.

    reference_model: False when the caller trains a model of its own; the checks that count the
    reference GPT's layers (pipeline parts) are then left to the partition of that model.
    layers: (sections, origin) applied over `source` and under `overrides`, in order: a DeepSpeed
    config's translation (deepspeed.py), named as its origin in errors.
    """
    sources: Sources = {}
    if isinstance(source, Config):
        cfg = replace(source, **{f.name: replace(getattr(source, f.name), **{
            g.name: check_value(f.name, g, getattr(getattr(source, f.name), g.name))
            for g in fields(getattr(source, f.name))}) for f in fields(Config)})
    elif source is None:
        cfg = Config()
    elif isinstance(source, Mapping):
        cfg = _build(source, "the config dict", Config(), sources)
    elif isinstance(source, (str, Path)):
        cfg = _build(_read_file(Path(source)), str(source), Config(), sources)
    else:
        raise ConfigError(f"config must be a path, dict or Config, got {type(source).__name__}")
    for sections, origin in layers:
        cfg = _build(sections, origin, cfg, sources)
    for text in overrides:
        section, key, value = parse_override(text)
        cfg = _build({section: {key: value}}, f"--set {text.strip()}", cfg, sources)
    cfg = check_cross(cfg, sources, reference_model)
    return cfg, sources


def load_config(source: str | Path | Mapping[str, Any] | Config | None = None,
                overrides: Sequence[str] = ()) -> Config:
    """`resolve` without the sources."""
    return resolve(source, overrides)[0]


def _src(sources: Sources, key: str) -> str:
    return sources.get(key, "default")


def reference_layer_params(cfg: Config) -> list[int]:
    """Parameters of each of the reference GPT's ``model.layers`` at tp = 1 (embedding, blocks, norm, head)."""
    from ..model.reference_gpt import layer_params

    m = cfg.model
    return layer_params(m.n_layers, m.d_model, m.vocab_size, m.seq_len)


def reference_layer_flops(cfg: Config) -> list[int]:
    """Forward FLOPs per token of each of the reference GPT's ``model.layers`` at tp = 1: a block's
    matmuls (qkv 6d^2, output 2d^2, MLP 16d^2) and attention (QK^T and AV, 2 seq d each), the head's
    2 d vocab; the embedding lookup and the norms count 0."""
    from ..model.reference_gpt import layer_flops

    m = cfg.model
    return layer_flops(m.n_layers, m.d_model, m.vocab_size, m.seq_len)


def reference_param_count(cfg: Config) -> int:
    """Parameters of the reference GPT (tensorpar.build_gpt) at tp = 1: for budget checks."""
    return sum(reference_layer_params(cfg))


def reference_gpt_config(cfg: Config):  # noqa: ANN201 - a capstan.tensorpar.GPTConfig (imported lazily)
    """The reference GPT's `GPTConfig` from [model]."""
    from capstan.tensorpar import GPTConfig

    m, mem = cfg.model, cfg.memory
    return GPTConfig(vocab_size=m.vocab_size, seq_len=m.seq_len, d_model=m.d_model, n_heads=m.n_heads,
                     n_layers=m.n_layers, dropout=m.dropout, loss_tile=-1 if mem.tiled_loss else 0,
                     mlp_tile=mem.mlp_tile)


def uses_chunks(cfg: Config) -> bool:
    """True when model states live in capstan.chunkmem (offload or ZeRO stage 3)."""
    return cfg.memory.offload != "none" or cfg.parallel.zero_stage == 3


def _clamp_defaults(cfg: Config, sources: Sources) -> Config:
    """Defaults that conflict with what the user set are fitted to it with a notice (warmup longer
    than the run, a minimum learning rate above the learning rate); a conflict between two values the
    user set stays an error (check_cross)."""
    t = cfg.train
    changes: dict[str, Any] = {}
    if t.warmup_steps > t.steps and "train.warmup_steps" not in sources:
        changes["warmup_steps"] = max(0, t.steps - 1)
        _notice(f"train.warmup_steps: the default {t.warmup_steps} exceeds train.steps = {t.steps}: "
                f"{changes['warmup_steps']} warmup steps")
    if t.min_lr > t.lr and "train.min_lr" not in sources:
        changes["min_lr"] = t.lr / 10
        _notice(f"train.min_lr: the default {t.min_lr} exceeds train.lr = {t.lr}: min_lr = {changes['min_lr']}")
    return replace(cfg, train=replace(t, **changes)) if changes else cfg


def _notice(text: str) -> None:
    logging.getLogger("capstan.engine.config").warning("%s", text)


def check_cross(cfg: Config, sources: Sources, reference_model: bool = True) -> Config:
    """Rules between fields that need no processes; raises the first violation, returns the config with
    conflicting defaults fitted (`_clamp_defaults`)."""
    cfg = _clamp_defaults(cfg, sources)
    reference_model = reference_model and cfg.model.hf is None  # model.hf: a transformers model's own sizes
    m, p, t, mem, d = cfg.model, cfg.parallel, cfg.train, cfg.memory, cfg.data
    if reference_model and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model = {m.d_model} must be divisible by model.n_heads = {m.n_heads}")
    if reference_model and m.n_heads % p.tp:
        raise ConfigError(f"parallel.tp = {p.tp} must divide model.n_heads = {m.n_heads} "
                          f"(tp from {_src(sources, 'parallel.tp')})")
    if d.tokenizer == "byte" and not d.source.endswith(".bin") and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the byte tokenizer's 256 ids")
    if d.tokenizer == "bpe" and not d.source.endswith(".bin"):
        _check_bpe(cfg)
    if d.tokenizer_file is not None and d.tokenizer != "bpe":
        raise ConfigError(f"data.tokenizer_file is set but data.tokenizer = {d.tokenizer!r}: it only applies to "
                          "data.tokenizer = \"bpe\"")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr} must not exceed train.lr = {t.lr}")
    if t.warmup_steps > t.steps:
        raise ConfigError(f"train.warmup_steps = {t.warmup_steps} exceeds train.steps = {t.steps}")
    if p.sequence_parallel and p.tp < 2:
        raise ConfigError(f"parallel.sequence_parallel needs parallel.tp > 1 (got tp = {p.tp}, tp from "
                          f"{_src(sources, 'parallel.tp')}): it splits the sequence over the tensor-parallel ranks")
    if p.sequence_parallel and m.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel: model.seq_len = {m.seq_len} must be divisible by "
                          f"parallel.tp = {p.tp} (each tp rank holds seq_len / tp tokens)")
    if p.pp > 1:
        _check_pipeline(cfg, sources, reference_model)
    if p.cp > 1:
        _check_context(cfg, sources, reference_model)
    if p.virtual_stages > 1 and p.schedule != "interleaved":
        raise ConfigError(f"parallel.virtual_stages = {p.virtual_stages} needs parallel.schedule = "
                          f"\"interleaved\", got {p.schedule!r}")
    if mem.ram_limit is not None and (mem.cpu_budget is None or mem.cpu_budget > mem.ram_limit
                                      or not uses_chunks(cfg)):
        raise ConfigError(f"memory.ram_limit = {mem.ram_limit} needs chunked memory (offload or ZeRO-3) and a "
                          f"memory.cpu_budget no larger than it for the warm-up step (cpu_budget = {mem.cpu_budget})")
    if mem.chunk_order == "trace" and (p.pp > 1 or not uses_chunks(cfg)):
        raise ConfigError("memory.chunk_order = \"trace\" needs chunked memory (offload or ZeRO-3) and "
                          f"parallel.pp = 1 (got pp = {p.pp}): pipeline stages are registered in layer order")
    if mem.gpu_budget is not None and (not uses_chunks(cfg) or t.device == "cpu"):
        raise ConfigError(f"memory.gpu_budget = {mem.gpu_budget} needs chunked memory (memory.offload = \"cpu\" or "
                          f"\"disk\", or parallel.zero_stage = 3) on a GPU (train.device = \"cuda\" or \"auto\"); "
                          f"got offload = {mem.offload!r}, zero_stage = {p.zero_stage}, device = {t.device!r}")
    if mem.overlap_optimizer and not uses_chunks(cfg):
        raise ConfigError("memory.overlap_optimizer = true needs chunked memory (memory.offload = \"cpu\" or "
                          f"\"disk\"); got offload = {mem.offload!r}, zero_stage = {p.zero_stage}")
    if mem.activation_offload and not (mem.activation_checkpointing and reference_model):
        raise ConfigError("memory.activation_offload moves the inputs of recomputed blocks: it needs "
                          "memory.activation_checkpointing = true and the reference GPT (a module of your own "
                          "passes keeper=capstan.chunkmem.ActivationOffload... to capstan.tensorpar.recompute)")
    if cfg.precision.master_weights == "bf16":
        _check_bf16_master(cfg, sources)
    if p.compression != "none":
        _check_compression(cfg, sources)
    if uses_chunks(cfg):
        _check_chunk_path(cfg, sources, reference_model)
    elif mem.cpu_budget is not None:
        raise ConfigError("memory.cpu_budget only applies to chunked memory: set memory.offload = \"cpu\" "
                          "or \"disk\" (or parallel.zero_stage = 3)")
    return cfg


def _check_bf16_master(cfg: Config, sources: Sources) -> None:
    """precision.master_weights = "bf16": bf16 parameters that are their own master, in chunks (chunkmem's
    ChunkedModel) or in the flat ZeRO 0-2 buffer (zero/optimizer.py); 1-bit Adam's replicated chunks and
    the flat buffer's int8-compressed master shard keep fp32."""
    pr, p = cfg.precision, cfg.parallel
    what = f"precision.master_weights = \"bf16\" (from {_src(sources, 'precision.master_weights')})"
    if pr.dtype != "bf16":
        raise ConfigError(f"{what} needs precision.dtype = \"bf16\" (got {pr.dtype!r}): the bf16 parameters are "
                          "the master")
    if p.compression == "onebit":
        raise ConfigError(f"{what} cannot be used with parallel.compression = \"onebit\": 1-bit Adam's replicated "
                          "chunks keep an fp32 master")
    if p.compression == "int8" and not uses_chunks(cfg):
        raise ConfigError(f"{what} cannot be used with parallel.compression = \"int8\" on the flat ZeRO 1-2 "
                          "buffer: its quantized gathers come from an exact fp32 master shard (in chunks, ZeRO-3 "
                          "or offload, it can)")


def _check_compression(cfg: Config, sources: Sources) -> None:
    """parallel.compression where it is sound (and built): 1-bit Adam all-reduces the whole momentum on
    every dp rank, so ZeRO may not shard it (offload replicates the chunks instead); int8 compresses ZeRO's
    reduce-scatter and all-gather."""
    p, mem = cfg.parallel, cfg.memory
    where = f"zero_stage = {p.zero_stage} (from {_src(sources, 'parallel.zero_stage')}), offload = {mem.offload!r}"
    if p.compression == "onebit" and p.zero_stage != 0:
        raise ConfigError(f"parallel.compression = \"onebit\" needs parallel.zero_stage = 0 (got {where}): 1-bit "
                          "Adam all-reduces the whole momentum on every dp rank, which ZeRO 1-3 shard (with "
                          "memory.offload the chunks are then replicated on every dp rank)")
    if p.compression == "int8" and p.zero_stage == 0 and mem.offload == "none":
        raise ConfigError(f"parallel.compression = \"int8\" needs parallel.zero_stage 1-3 or offload (got {where}): "
                          "it quantizes ZeRO's gradient reduce-scatter and parameter all-gather, which ZeRO 0's "
                          "all-reduce does not have (1-bit Adam, \"onebit\", compresses ZeRO 0)")
    if p.compression == "onebit" and cfg.precision.optimizer_states != "fp32":
        raise ConfigError(f"precision.optimizer_states = {cfg.precision.optimizer_states!r} (from "
                          f"{_src(sources, 'precision.optimizer_states')}) cannot be used with parallel.compression = "
                          "\"onebit\": 1-bit Adam's compressed step keeps its own fp32 momentum and variance; "
                          "use optimizer_states = \"fp32\" or another compression")


def _check_bpe(cfg: Config) -> None:
    """data.tokenizer = "bpe": the package is there, and a vocabulary to train or a file to load."""
    from importlib.util import find_spec

    d, v = cfg.data, cfg.model.vocab_size
    if find_spec("tokenizers") is None:
        raise ConfigError("data.tokenizer = \"bpe\" needs the tokenizers package: pip install tokenizers "
                          "(or capstan-engine[bpe])")
    if d.tokenizer_file is not None:
        path = Path(d.tokenizer_file)
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            raise ConfigError(f"data.tokenizer_file = {d.tokenizer_file!r} is a folder without a tokenizer.json "
                              "(a fast tokenizer's save_pretrained writes one)")
        if not path.exists():
            raise ConfigError(f"data.tokenizer_file = {d.tokenizer_file!r} does not exist (expected a tokenizer.json "
                              "or a folder holding one)")
    elif v <= 256:
        raise ConfigError(f"model.vocab_size = {v} leaves data.tokenizer = \"bpe\" no merges: a byte-level BPE "
                          "needs more than its 256 byte ids (e.g. 512 or more)")


def _check_pipeline(cfg: Config, sources: Sources, reference_model: bool = True) -> None:
    """pp > 1: what the engine's pipeline (pipe.py) can run."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    parts = p.pp * p.virtual_stages
    layers = m.n_layers + 3  # embedding, blocks, final norm, head
    if reference_model and layers < parts:
        raise ConfigError(f"parallel.pp * virtual_stages = {p.pp} * {p.virtual_stages} = {parts} pipeline parts, "
                          f"but the model has only {layers} layers (model.n_layers = {m.n_layers} blocks + "
                          "embedding, final norm and head); every part needs at least one")
    if p.schedule == "interleaved":
        if p.virtual_stages < 2:
            raise ConfigError(f"parallel.schedule = \"interleaved\" needs parallel.virtual_stages >= 2 (model "
                              f"chunks per stage), got {p.virtual_stages}; or use schedule = \"1f1b\"")
        if t.grad_accum_steps % p.pp:
            raise ConfigError(f"parallel.schedule = \"interleaved\": train.grad_accum_steps = {t.grad_accum_steps} "
                              f"(the pipeline's microbatches) must be a multiple of parallel.pp = {p.pp} "
                              f"(pp from {_src(sources, 'parallel.pp')})")


def _check_chunk_path(cfg: Config, sources: Sources, reference_model: bool = True) -> None:
    mem, p = cfg.memory, cfg.parallel
    # Unset, the chunk size is chosen per model (at least 1024 elements) once the model exists.
    chunk = (f"memory.chunk_size = {mem.chunk_size} fp32 elements" if mem.chunk_size is not None
             else "the smallest chunk (1024 fp32 elements; memory.chunk_size unset)")
    chunk_bytes = (mem.chunk_size or 1024) * 4
    # offload = "disk" without cpu_budget: chosen from the machine's RAM at start (ram_budget.py)
    if mem.cpu_budget is not None and mem.cpu_budget < chunk_bytes:
        raise ConfigError(f"memory.cpu_budget = {mem.cpu_budget} bytes cannot hold one chunk of "
                          f"{chunk} ({chunk_bytes} bytes)")
    # One rank holds the whole model: checked here, before anything is built. Under dp, tp, pp or cp each rank
    # holds its share, which the engine counts once the model exists (machine/room.py), as for a model of
    # one's own (the whole reference GPT against one rank's budget refused layouts that fit).
    single = p.tp == 1 and p.pp == 1 and p.cp == 1 and (p.dp == 1 or p.dp == 0 and _launch_world() == 1)
    if mem.offload == "cpu" and mem.cpu_budget is not None and reference_model and single:
        check_states_fit(mem.cpu_budget, reference_param_count(cfg), cfg)


def gradient_bytes_per_param(cfg: Config, sharded: bool = False, onebit_replicas: int = 0) -> float:
    """Bytes of chunks a parameter's gradient takes of its own: fp32 beside fp32 compute, bf16 beside a bf16
    master, fp32 under ZeRO-3 (`sharded`: reduce-scattered into the owners' fp32 chunks) and 1-bit Adam's
    replicated chunks (`onebit_replicas` > 0: averaged over them in fp32), and beside a 16-bit parameter
    under gradient accumulation (several backwards add up); 0 where a 16-bit gradient takes its parameter's
    slot once backward is done with it (chunkmem's ChunkedModel.grad_chunks)."""
    pr = cfg.precision
    if sharded or onebit_replicas or pr.dtype == "fp32":
        return 4
    if pr.master_weights == "bf16":
        return 2
    return 4 if cfg.train.grad_accum_steps > 1 else 0


def _launch_world() -> int | None:
    """The world size the launch environment names (None where it cannot be read): parallel.dp = 0 is then
    known before any process group exists."""
    from capstan.comm import LaunchError, detect_launch

    try:
        return detect_launch().world_size
    except LaunchError:
        return None


def state_bytes_per_param(cfg: Config, sharded: bool = False, onebit_replicas: int = 0) -> float:
    """Bytes of chunks a parameter takes at the least (padding aside): its parameter and master, its
    gradient (`gradient_bytes_per_param`), both moments in `precision` (docs/chunkmem.md, "Mixed
    precision" and "A bf16 master"), and with 1-bit Adam over `onebit_replicas` replicas its two fp32
    residuals (the whole and one replica's part: chunkmem's ReplicatedChunkedModel)."""
    pr = cfg.precision
    held = 2 * MOMENT_BYTES[pr.optimizer_states] + gradient_bytes_per_param(cfg, sharded, onebit_replicas)
    if onebit_replicas:
        held += 4 + 4 / onebit_replicas
    if pr.dtype == "fp32":
        return 4 + held  # the parameter is the master
    if pr.master_weights == "bf16":
        return 2 + held  # the bf16 parameter is the master
    return 2 + 4 + held  # a 16-bit parameter and its fp32 master


def drops_gradients(cfg: Config, overlap: bool, sharded: bool = False) -> bool:  # (1-bit Adam: never overlaps)
    """Whether the overlapped optimizer consumes each chunk group's gradient during backward and drops it, so
    that no moment of the step holds them all (chunkmem optim/overlap.py, "Past RAM"): where the step streams
    (a cpu budget or the disk tier) with neither clipping nor fp16's loss scaling (no step can be redone),
    one backward a step (accumulation keeps every gradient chunk across the micro-batches) and no sharding."""
    mem, t = cfg.memory, cfg.train
    streams = mem.cpu_budget is not None or mem.offload == "disk"
    return (overlap and streams and not sharded and not t.grad_clip and cfg.precision.dtype != "fp16"
            and t.grad_accum_steps == 1)


def persistent_bytes_per_param(cfg: Config, sharded: bool = False, drops_grads: bool = False,
                               onebit_replicas: int = 0) -> float:
    """Bytes of chunks a parameter keeps all step at the least: `state_bytes_per_param`, less its gradient where
    the overlapped optimizer drops it during backward (`drops_gradients`)."""
    per = state_bytes_per_param(cfg, sharded, onebit_replicas)
    return per - gradient_bytes_per_param(cfg, sharded) if drops_grads else per


def states_fit_error(cpu_budget: int, params: int, cfg: Config, sharded: bool = False,
                     onebit_replicas: int = 0) -> str | None:
    """memory.offload = "cpu" keeps every chunk in RAM: what is wrong where the budget cannot hold the model
    states of `params` parameters (None where it can)."""
    per = state_bytes_per_param(cfg, sharded, onebit_replicas)
    need = int(per * params)
    if cpu_budget >= need:
        return None
    return (f"memory.offload = \"cpu\" keeps every chunk in RAM: memory.cpu_budget = {cpu_budget} bytes is below "
            f"the model states' {need} bytes ({params} parameters x {per:g} bytes; use offload = \"disk\" or a "
            "larger budget)")


def check_states_fit(cpu_budget: int, params: int, cfg: Config) -> None:
    """memory.offload = "cpu" keeps every chunk in RAM: the budget must hold the model states."""
    error = states_fit_error(cpu_budget, params, cfg)
    if error is not None:
        raise ConfigError(error)


def check_world(cfg: Config, world_size: int, world_source: str, sources: Sources) -> int:
    """dp * tp * pp (* cp) against the world size (before any process group); returns the data-parallel degree."""
    p = cfg.parallel
    axes = ("tp", "pp", "cp") if p.cp > 1 else ("tp", "pp")
    product = p.tp * p.pp * p.cp
    named = " * ".join(f"parallel.{a}" for a in axes)
    sizes = " * ".join(str(getattr(p, a)) for a in axes)
    where = ", ".join(f"{a} from {_src(sources, 'parallel.' + a)}" for a in axes)
    if p.dp == 0:
        if world_size % product:
            raise ConfigError(f"{world_source} is not divisible by {named} = {sizes} ({where})")
        dp = world_size // product
    else:
        dp = p.dp
        if dp * product != world_size:
            raise ConfigError(
                f"parallel.dp * {' * '.join(axes)} = {dp} * {sizes} = {dp * product} (dp from "
                f"{_src(sources, 'parallel.dp')}, {where}) but {world_source}")
    return dp


def _check_context(cfg: Config, sources: Sources, reference_model: bool) -> None:
    """parallel.cp > 1: the reference GPT, no dropout, a sequence (and heads) that split (tensorpar.context)."""
    from capstan.tensorpar.context import check_context_sizes

    m, p = cfg.model, cfg.parallel
    if not reference_model:
        raise ConfigError(f"parallel.cp = {p.cp}: context parallelism splits the reference GPT's attention; a model of "
                          "your own (or model.hf) runs at cp = 1")
    if m.dropout > 0:
        raise ConfigError(f"parallel.cp = {p.cp} needs model.dropout = 0 (got {m.dropout}): attention dropout is not "
                          "available across a split sequence")
    try:
        check_context_sizes(m.seq_len, m.n_heads // p.tp, p.cp, p.cp_mode)
    except ValueError as exc:
        raise ConfigError(f"parallel.cp = {p.cp} (cp_mode = {p.cp_mode!r}, cp from {_src(sources, 'parallel.cp')}): "
                          f"{exc}") from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a TOML basic string is a JSON string for our values


def to_toml(cfg: Config, derived: Mapping[str, int] | None = None) -> str:
    """The config as TOML (unset optional values omitted), loadable by `resolve`."""
    lines = []
    if derived:
        lines += ["# derived: " + ", ".join(f"{k} = {v}" for k, v in derived.items()), ""]
    for section, body in cfg.as_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items() if v is not None]
        lines.append("")
    return "\n".join(lines)

