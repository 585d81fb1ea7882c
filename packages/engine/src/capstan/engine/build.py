"""`initialize(model=..., config=...)`: config -> topology -> model on it -> `Engine`.

    from capstan.engine import initialize
    engine = initialize(config="examples/tiny.toml")            # the reference GPT from [model]
    engine = initialize(model=my_module, config={"train": {"lr": 3e-4}})
    engine = initialize(model=lambda cfg, groups: build(cfg, groups.tp), config=cfg)

With ``parallel.pp > 1`` each rank builds only its pipeline stage's layers of
the reference GPT (`pipe.PipelineStage`), or keeps its stage's share of a model
of your own given as an ``nn.Sequential`` or a list of
`capstan.pipeline.LayerSpec` (tp = 1; `loss_fn` runs on the last stage)::

    engine = initialize(model=[LayerSpec(make_embedding), *blocks, LayerSpec(make_head)],
                        config={"parallel": {"pp": 2}, "train": {"grad_accum_steps": 4}},
                        loss_fn=my_loss)

Works as one plain process (no process group is started for a world of one)
and under mpirun / torchrun (it calls `comm.init()` when the launcher says
there are several processes). The config is fully checked, including
dp * tp * pp against the world size, before any process group starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from capstan import comm
from capstan.chunkmem.memory.nonmodel import trim_heap
from capstan.comm.device import is_accelerator

from .config.load import ConfigError, check_world, reference_gpt_config, resolve, uses_chunks
from .config.schema import Config
from .engine import Engine, LossFn
from .ram_budget import with_default_cpu_budget

__all__ = ["initialize", "build_reference_model", "build_reference_on_meta", "LayerwiseInit", "recompute_blocks",
           "resolve_device", "resolve_groups", "slice_for_tp"]

ModelSpec = nn.Module | Sequence[Any] | Callable[[Config, comm.Groups], nn.Module] | None


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


def _check_gpu_chunks(cfg: Config, groups: comm.Groups) -> None:
    """What chunked memory on a GPU does not do yet, refused alike on every rank before anything is built."""
    if cfg.memory.ram_limit is not None:
        raise ConfigError("memory.ram_limit on a GPU is not built yet: the non-model memory it follows is measured "
                          "in RAM; use memory.cpu_budget (and memory.gpu_budget for the GPU)")


def resolve_groups(cfg: Config, sources: dict[str, str]) -> comm.Groups:
    """Check the layout against the launch, start comm if needed, and build the dp/pp/tp groups."""
    if comm.is_initialized():
        size, where = comm.world().size, comm.launch().describe("world_size")
    else:
        launch = comm.detect_launch()
        size, where = launch.world_size, launch.describe("world_size")
    dp = check_world(cfg, size, where, sources)  # before any process group exists
    device = resolve_device(cfg)
    if size == 1 and not comm.is_initialized():
        from capstan.comm.log import set_rank_context

        set_rank_context(0, (0, 0, 0))  # log lines say "rank 0 0/0/0", as under a launcher
        if is_accelerator(device):
            torch.accelerator.set_device_index(device.index)
        return comm.single_process_groups()
    comm.init(device=device)
    return comm.build_groups(comm.Topology(dp=dp, pp=cfg.parallel.pp, tp=cfg.parallel.tp, cp=cfg.parallel.cp))


def _default_loss(model: nn.Module) -> LossFn:
    if callable(getattr(model, "loss", None)):
        return model.loss  # the reference GPT: vocab-parallel cross-entropy
    from .pipe import token_cross_entropy

    return token_cross_entropy


def initialize(model: ModelSpec = None, config: str | Path | Mapping[str, Any] | Config | None = None, *,
               overrides: Sequence[str] = (), groups: comm.Groups | None = None,
               loss_fn: LossFn | None = None, deepspeed: str | Path | Mapping[str, Any] | None = None) -> Engine:
    """An `Engine` for `model` under `config`.

    model: None (the reference GPT from [model]), an nn.Module (fp32, the same
        on every rank or broadcast from dp rank 0), a builder
        ``fn(config, groups) -> nn.Module`` (for tensor-parallel user models), or
        a list of `capstan.pipeline.LayerSpec` (one nn.Sequential at pp = 1, each
        stage's layers only at pp > 1). With pp > 1 a module must be an nn.Sequential.
    config: a Config, a dict of sections, or a TOML/JSON path; `overrides`
        are ``section.key=value`` strings as on the command line.
    groups: existing comm groups (their world must match the config's layout).
    loss_fn: ``fn(outputs, targets) -> mean loss``; default: the model's
        ``.loss`` method if it has one, else token-level cross-entropy.
    deepspeed: a DeepSpeed config (a JSON path or a dict), translated over `config` and under
        `overrides` (config/deepspeed.py); what has no equivalent is logged once.
    """
    layers = []
    if deepspeed is not None:
        from .config.deepspeed import data_parallel_size, from_deepspeed

        world = groups.world.size if groups is not None else comm.detect_launch().world_size
        sections, notes = from_deepspeed(deepspeed, data_parallel_size(config, overrides, world))
        for note in notes:
            comm.log_rank0(comm.get_logger(__name__), "deepspeed: %s", note)
        layers.append((sections, "the DeepSpeed config"))
    cfg, sources = resolve(config, overrides, reference_model=model is None, layers=layers)
    if model is None and cfg.model.hf is not None:
        model = build_hf_model(cfg)
    if groups is None:
        groups = resolve_groups(cfg, sources)
    else:
        check_world(cfg, groups.world.size, f"world size {groups.world.size} of the given groups", sources)
    device = resolve_device(cfg)
    if is_accelerator(device) and uses_chunks(cfg):
        _check_gpu_chunks(cfg, groups)
    cfg = with_default_cpu_budget(cfg, groups, reference_model=model is None)  # a disk tier's, where unset
    torch.manual_seed(cfg.train.seed)
    if cfg.parallel.pp > 1:
        from .pipe import PipelineStage, user_layer_specs

        if model is None:
            if loss_fn is not None:
                raise ValueError(f"parallel.pp = {cfg.parallel.pp} with the reference GPT: it brings its own "
                                 "(vocab-parallel) loss; pass loss_fn only with a model of your own")
            stage = PipelineStage(cfg, groups, device=device)
        else:
            if callable(model) and not isinstance(model, nn.Module):
                model = model(cfg, groups)
            from capstan.pipeline import HF_PIPELINE_FAMILIES, hf_layer_specs

            if isinstance(model, nn.Module) and not isinstance(model, nn.Sequential) and hf_layer_specs(model) is None:
                raise TypeError(f"parallel.pp = {cfg.parallel.pp} needs the model as a sequence of layers to split "
                                f"into stages: an nn.Sequential, a list of capstan.pipeline.LayerSpec, or a "
                                f"transformers language model ({', '.join(HF_PIPELINE_FAMILIES)}), "
                                f"not {type(model).__name__}")
            if isinstance(model, nn.Module) and any(p.is_meta for p in model.parameters()):
                raise ValueError(f"parallel.pp = {cfg.parallel.pp} with a model on the meta device: a pipeline "
                                 "of your own is built for real (give LayerSpecs, and each stage builds only "
                                 "its layers)")
            sliced = False
            if isinstance(model, nn.Module) and groups.tp.size > 1 and hf_layer_specs(model) is not None:
                model, sliced = slice_for_tp(model, groups), True  # a transformers decoder: its family's plan
            stage = PipelineStage(cfg, groups, user_layer_specs(model), loss_fn, device=device, sliced=sliced)
        engine = Engine(config=cfg, model=stage.module, groups=groups, loss_fn=stage.executor.loss_fn,
                        pipeline=stage, reference_model=model is None, init_fn=stage.init_fn, device=device)
        engine.activations = stage.activations
        engine.hf_source = hf_source(model)
        return engine
    if cfg.parallel.sequence_parallel and model is not None:
        raise ValueError("parallel.sequence_parallel slices the reference GPT; a model of your own sets it on its "
                         "capstan.tensorpar layers (sequence_parallel=True) and leaves the option off")
    if cfg.memory.activation_checkpointing and model is not None:
        raise ValueError("memory.activation_checkpointing recomputes the reference GPT's blocks (or a pipeline's "
                         "stage chunks); for a module of your own at pp = 1 wrap its blocks with "
                         "capstan.tensorpar.recompute(block) and leave the option off")
    init_fn, keeper = None, None
    if model is None:
        if uses_chunks(cfg):
            module, init_fn = build_reference_on_meta(cfg, groups)
        else:
            module = build_reference_model(cfg, groups)
        if cfg.memory.activation_checkpointing:
            keeper = activation_keeper(cfg, groups.world.rank, device)
            recompute_blocks(module.layers, keeper)
    elif isinstance(model, (list, tuple)):  # LayerSpecs, as for pp > 1: built here as one nn.Sequential
        from capstan.pipeline import build_layers, tie_layers

        from .pipe import user_layer_specs

        specs = user_layer_specs(model)
        seed = cfg.train.seed  # per-layer seeds, as pipe.py
        if uses_chunks(cfg) and not any(spec.tied for spec in specs):  # straight into chunks, layer by layer
            with torch.device("meta"):
                module = nn.Sequential(*build_layers(specs, range(len(specs)), seed=seed))
            init_fn = LayerwiseInit(list(module), [lambda i=i: build_layers(specs, [i], seed=seed)[0]
                                                   for i in range(len(specs))])
        else:
            layers = build_layers(specs, range(len(specs)), seed=seed)
            tie_layers(specs, layers)
            module = nn.Sequential(*layers)
    elif isinstance(model, nn.Module):
        module = slice_for_tp(model, groups) if groups.tp.size > 1 else model
    elif callable(model):
        module = model(cfg, groups)
        if not isinstance(module, nn.Module):
            raise TypeError(f"the model builder returned {type(module).__name__}, not an nn.Module")
    else:
        raise TypeError(f"model must be None, an nn.Module or a builder function, got {type(model).__name__}")
    on_meta = any(p.is_meta for p in module.parameters())
    if not uses_chunks(cfg) and on_meta:
        raise ValueError("the model's parameters are on the meta device (no values): only chunked memory "
                         "materializes them, module by module with reset_parameters(); set memory.offload = "
                         "\"cpu\" or \"disk\" (or parallel.zero_stage = 3), or build the model for real")
    if on_meta and init_fn is None and callable(getattr(module, "_init_weights", None)):
        init_fn = hf_init(module)
        hf_buffers(module)
    engine = Engine(config=cfg, model=module, groups=groups, loss_fn=loss_fn or _default_loss(module),
                    reference_model=model is None, init_fn=init_fn, device=device)
    engine.activations = keeper
    engine.hf_source = hf_source(module)
    return engine
