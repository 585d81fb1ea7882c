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

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from capstan import comm
from capstan.comm.job.accelerator import is_accelerator

from .config.load import ConfigError, check_world, resolve, uses_chunks
from .config.schema import Config
from .engine import Engine, LossFn
from .machine.ram_budget import with_default_cpu_budget
from .model.models import (
    LayerwiseInit,
    activation_keeper,
    build_hf_model,
    build_reference_model,
    build_reference_on_meta,
    hf_buffers,
    hf_init,
    hf_source,
    recompute_blocks,
    resolve_device,
    slice_for_tp,
)

# The model-building names are models.py's, re-exported here where callers have always found them.
__all__ = ["initialize", "build_reference_model", "build_reference_on_meta", "LayerwiseInit", "recompute_blocks",
           "resolve_device", "resolve_groups", "slice_for_tp", "activation_keeper"]

ModelSpec = nn.Module | Sequence[Any] | Callable[[Config, comm.Groups], nn.Module] | None


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
    from .model.pipe import token_cross_entropy

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
        from .model.pipe import PipelineStage, user_layer_specs

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

        from .model.pipe import user_layer_specs

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
