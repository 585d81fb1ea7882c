"""Building the model a run trains: the reference GPT (eager, or on the meta device with a per-layer
`LayerwiseInit` for chunked memory), transformers models from [model] (with their init and buffers),
slicing a model of one's own over tp, recomputed blocks and where their inputs wait, and the device of
this rank.

Its own module so that everything that builds a model or needs the device (initialize in build.py,
the pipeline stages in pipe.py, the RAM budget in ram_budget.py, the planner's probes) imports it
without importing the `Engine` it ends in: build.py constructs the Engine and imports this, never the
reverse (tools/import_graph.py checks that no import circle is left in the engine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from capstan import comm
from capstan.chunkmem.memory.nonmodel import trim_heap
from capstan.comm.job.accelerator import is_accelerator

from ..config.load import ConfigError, reference_gpt_config, uses_chunks
from ..config.schema import Config

__all__ = ["build_reference_model", "build_reference_on_meta", "LayerwiseInit", "build_hf_model", "hf_source",
           "hf_init", "hf_buffers", "slice_for_tp", "recompute_blocks", "activation_keeper", "resolve_device"]


def build_reference_model(cfg: Config, groups: comm.Groups) -> nn.Module:
    """The reference GPT of [model], sliced over the tp group, seeded by train.seed (tp-invariant init)."""
    from capstan.tensorpar import build_gpt
    from capstan.tensorpar.context import ContextParallel

    return build_gpt(reference_gpt_config(cfg), groups.tp, seed=cfg.train.seed,
                     sequence_parallel=cfg.parallel.sequence_parallel,
                     cp=ContextParallel.of(groups.cp, cfg.parallel.cp_mode))


def build_reference_on_meta(cfg: Config, groups: comm.Groups) -> tuple[nn.Module, LayerwiseInit]:
    """The reference GPT's structure on the meta device, and the `init_fn` that gives chunkmem its
    values: with chunked memory the model is built straight into chunks (one layer in RAM at a time),
    so a model larger than RAM never exists whole outside them."""
    from capstan.tensorpar import build_gpt, gpt_layer_factories
    from capstan.tensorpar.context import ContextParallel

    gpt, sp = reference_gpt_config(cfg), cfg.parallel.sequence_parallel
    cp = ContextParallel.of(groups.cp, cfg.parallel.cp_mode)
    with torch.device("meta"):
        model = build_gpt(gpt, groups.tp, seed=cfg.train.seed, sequence_parallel=sp, cp=cp)
    factories = gpt_layer_factories(gpt, groups.tp, cfg.train.seed, sequence_parallel=sp, cp=cp)
    return model, LayerwiseInit(model.layers, factories)


class LayerwiseInit:
    """`ChunkedModel(init_fn=...)` for a meta-device model whose layers have builders: a module's
    parameters get the values of the same module in its layer built for real (`factories[i]()`,
    seeded per layer, so equal to the eager model).

    Registration asks for modules group by group (tp-sliced weights of every layer first, then
    the replicated norms...), so a built layer is taken apart at once: each module's tensors wait
    in `stash` until asked for, and the layer itself is dropped. What waits is a layer's modules
    not yet asked for: the whole layer only until its large weights go, which come first."""

    def __init__(self, layers: Sequence[nn.Module], factories: Sequence[Callable[[], nn.Module]]) -> None:
        self.factories = factories
        self.where: dict[int, tuple[int, str]] = {}  # id(module) -> (layer index, name inside the layer)
        for i, layer in enumerate(layers):
            for name, module in layer.named_modules():
                self.where[id(module)] = (i, name)
        self.stash: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.built: set[int] = set()

    def __call__(self, module: nn.Module) -> None:
        key = self.where[id(module)]
        if key[0] not in self.built:
            self.built.add(key[0])
            layer = self.factories[key[0]]()
            for name, sub in layer.named_modules():
                values = {attr: p.detach() for attr, p in sub._parameters.items() if p is not None}
                if values:
                    self.stash[(key[0], name)] = values
            del layer
        values = self.stash.pop(key)
        for attr, param in module._parameters.items():
            if param is not None:
                param.copy_(values[attr])
        if sum(v.nbytes for v in values.values()) >= 1 << 20:
            del values
            trim_heap()  # else glibc keeps the freed pages, and RSS grows layer after layer


def build_hf_model(cfg: Config) -> nn.Module:
    """The transformers causal LM of ``model.hf``: from_pretrained where the directory holds weights,
    else from its config (on the meta device with chunked memory, so it goes straight into chunks)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.hf needs the transformers package: pip install 'capstan-engine[hf]'") from None
    path = Path(cfg.model.hf)
    directory = path.parent if path.is_file() else path
    if not (directory / "config.json").is_file() and not path.is_file():
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: no config.json there (a transformers model directory, "
                          "or its config.json)")
    try:
        hf_cfg = transformers.AutoConfig.from_pretrained(str(path if path.is_file() else directory))
        vocab = getattr(hf_cfg, "vocab_size", 0)
        positions = getattr(hf_cfg, "max_position_embeddings", None) or getattr(hf_cfg, "n_positions", None)
        if cfg.data.tokenizer == "byte" and not cfg.data.source.endswith(".bin") and vocab < 256:
            raise ConfigError(f"model.hf: the model's vocab_size {vocab} is below the byte tokenizer's 256 ids")
        if positions is not None and cfg.model.seq_len > positions:
            raise ConfigError(f"model.seq_len = {cfg.model.seq_len} exceeds model.hf's {positions} positions")
        weights = any((directory / f).exists() for f in ("model.safetensors", "model.safetensors.index.json",
                                                         "pytorch_model.bin", "pytorch_model.bin.index.json"))
        if weights:
            return transformers.AutoModelForCausalLM.from_pretrained(str(directory), config=hf_cfg,
                                                                     dtype=torch.float32)
        torch.manual_seed(cfg.train.seed)
        if uses_chunks(cfg) and cfg.parallel.tp == 1 and cfg.parallel.pp == 1:
            with torch.device("meta"):
                return transformers.AutoModelForCausalLM.from_config(hf_cfg)
        return transformers.AutoModelForCausalLM.from_config(hf_cfg)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: transformers could not build it: "
                          f"{' '.join(str(exc).split())[:300]}") from None


def hf_source(model: object) -> dict | None:
    """What a checkpoint of a transformers model records for `capstan checkpoint export --format hf`:
    its config (as its config.json holds it) and class; None for any other model."""
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or not callable(getattr(config, "to_json_string", None)):
        return None
    import json

    n_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    return {"config": json.loads(config.to_json_string(use_diff=False)), "architecture": type(model).__name__,
            "model_type": getattr(config, "model_type", None), "n_layers": n_layers}


def hf_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """`ChunkedModel(init_fn=...)` for a transformers model built on the meta device (``with
    torch.device("meta"): LlamaForCausalLM(config)``): each module, materialized on its own into its
    chunks, gets the model's own initialization (`_init_weights`: normal(0, initializer_range) for
    linear and embedding weights, ones for norms), so a model larger than RAM never exists whole."""
    def init(module: nn.Module) -> None:
        with torch.no_grad():
            model._init_weights(module)  # type: ignore[operator]

    return init


def hf_buffers(model: nn.Module) -> None:
    """Give the buffers of a transformers model built on the meta device their values (chunked memory
    materializes parameters only): each module holding meta buffers (rotary frequencies, position
    ids) is built once more for real from its config and its buffers are taken; such modules hold no
    large parameters. A meta buffer nothing can compute is an error naming it."""
    for name, module in model.named_modules():
        meta = [b for b, buf in module.named_buffers(recurse=False) if buf is not None and buf.is_meta]
        if not meta:
            continue
        config = getattr(module, "config", None)
        try:
            with torch.device("cpu"):
                real = type(module)(config=config) if config is not None else None
        except Exception:  # another constructor: no way to recompute it here
            real = None
        if real is None:
            raise ValueError(f"module {name or type(module).__name__} of the meta-device model holds buffers "
                             f"{meta} with no values: build it for real, or give it a `config` to rebuild from")
        for b in meta:
            module._buffers[b] = real._buffers[b]


def slice_for_tp(model: nn.Module, groups: comm.Groups) -> nn.Module:
    """A model of one's own at tp > 1: a Hugging Face model of a family with a shipped plan
    (capstan.tensorpar.hf_plan) is sliced with it, after every rank of the tp group takes rank 0's
    values (the slices must come from one model); a model already made of capstan.tensorpar layers
    is taken as it is; anything else is refused naming what to give."""
    from capstan.tensorpar import HF_FAMILIES, hf_plan, parallelize

    tp = groups.tp.size
    if any(getattr(p, "tp_dim", None) is not None for p in model.parameters()):
        return model  # sliced already (capstan.tensorpar layers)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"parallel.tp = {tp} with a model on the meta device: slicing needs its values; build it "
                         "for real, or at tp = 1 (chunked memory materializes it into chunks)")
    plan = hf_plan(model, tp)
    if plan is None:
        raise ValueError(f"parallel.tp = {tp} with {type(model).__name__}: capstan ships tensor-parallel plans for "
                         f"transformers models of the families {', '.join(sorted(HF_FAMILIES))}; for another model "
                         "pass a builder fn(config, groups) that slices it with capstan.tensorpar.parallelize(model, "
                         "plan, groups.tp) (docs/tensorpar.md), or use tp = 1")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if not t.is_meta:
                comm.broadcast(t.data, src=0, group=groups.tp)
    return parallelize(model, plan, groups.tp)


def recompute_blocks(layers: Iterable[nn.Module], keeper: object | None = None) -> int:
    """memory.activation_checkpointing: recompute every transformer block among `layers` (tensorpar's
    ParallelBlock, whose dropout masks `recompute` replays), their inputs kept by `keeper` (an
    ActivationOffload: offloaded, or counted for the memory report); returns how many."""
    from capstan.tensorpar import ParallelBlock, recompute

    blocks = [layer for layer in layers if isinstance(layer, ParallelBlock)]
    for block in blocks:
        recompute(block, keeper=keeper)  # type: ignore[arg-type]
    return len(blocks)


def activation_keeper(cfg: Config, rank: int, device: torch.device) -> object:
    """Where recomputed blocks' inputs wait for backward: memory.activation_offload moves them (pinned RAM
    from a GPU, the disk on the CPU); otherwise they stay and are counted for the memory report."""
    from capstan.chunkmem import ActivationOffload

    if not cfg.memory.activation_offload:
        return ActivationOffload.counting()
    if is_accelerator(device):
        return ActivationOffload.to_host(device)
    return ActivationOffload.to_disk(Path(cfg.memory.disk_dir) / "activations", rank)


def resolve_device(cfg: Config, local_rank: int | None = None) -> torch.device:
    """The device of this rank from train.device (comm.pick_device), with the checks that need torch:
    "cuda" without a GPU, or memory.gpu_budget where "auto" found no GPU, is a ConfigError."""
    if local_rank is None:
        local_rank = comm.launch().local_rank if comm.is_initialized() else comm.detect_launch().local_rank
    try:
        device = comm.pick_device(cfg.train.device, local_rank)
    except comm.DeviceError as exc:
        raise ConfigError(f"train.device = \"{cfg.train.device}\": {exc}") from None
    if not is_accelerator(device) and cfg.memory.gpu_budget is not None:
        raise ConfigError(f"memory.gpu_budget = {cfg.memory.gpu_budget} needs a GPU, but train.device = "
                          f"\"{cfg.train.device}\" found none (torch.cuda.is_available() is False)")
    return device
