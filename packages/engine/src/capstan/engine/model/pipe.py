"""The engine's pipeline stage: this rank's layers of the model, run by capstan.pipeline.

With ``parallel.pp > 1`` the reference GPT's ``model.layers`` ([embedding,
blocks..., final norm, head], untied) are partitioned over ``groups.pp`` (by
``parallel.partition``: parameter count, forward FLOPs, measured time or layer count), and
each rank builds only the layers of its stage (its chunks, with
interleaving), sliced over ``groups.tp``. Every layer draws its values from
its own seed (`tensorpar.gpt_layer_factories`), so a stage's layers equal the
one-process model's.

A model of the user's own is a sequence of layers, as DeepSpeed's
PipelineModule takes: a list of `capstan.pipeline.LayerSpec` (each stage
builds only its own layers; `tied` specs share a weight across stages) or an
``nn.Sequential`` (already built on every rank; each keeps its stage's
children). It is partitioned the same way (FLOPs counted on a micro-batch of
token ids), with tp = 1, and trained
with the caller's loss on the last stage. Parameter names in checkpoints are
``<layer index>.<name>``: those of the same layers as one ``nn.Sequential``.

The ``grad_accum_steps`` micro-batches of a step are the pipeline's
microbatches (as in DeepSpeed): `PipelineStage.train_step` runs the configured
schedule through `PipelineExecutor` and leaves the gradients of the mean loss
in the parameters' ``.grad`` for the engine's `ZeroOptimizer` (which then
works over ``groups.dp`` on this stage's parameters only). The loss exists on
the last stage; it is broadcast over the pipeline group so every rank reports
the same value. `eval_loss` is a forward-only pass along the virtual stages.

Example (every rank of a dp x pp x tp job; `initialize` does this for you)::

    stage = PipelineStage(cfg, groups)
    loss = stage.train_step(xs, ys)      # lists of grad_accum_steps micro-batches
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from capstan import comm

from ..config.load import (
    reference_gpt_config,
    reference_layer_flops,
    reference_layer_params,
    uses_chunks,
)
from ..config.schema import Config
from ..precision import autocast
from ..zero.optimizer import STAGE_COPY_ATTR
from .outputs import logits_of

__all__ = ["PipelineStage", "SCHEDULE_NAMES", "balanced_bounds", "reference_layer_times", "token_cross_entropy",
           "user_layer_specs", "user_partition"]

# parallel.schedule -> capstan.pipeline.SCHEDULES key
SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved-1f1b"}


class _Count(nn.Module):
    """A stand-in with `n` parameters, built on the meta device only, to plan a partition."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(n))


def balanced_bounds(cfg: Config, parts: int, world: comm.Group | None = None) -> tuple[int, ...]:
    """The reference GPT's layer boundaries of `parts` contiguous parts by ``parallel.partition``.

    capstan.pipeline counts parameters and FLOPs by building layers on the meta device, which
    tensorpar's layers (built from full CPU tensors, then sliced) do not support; the reference GPT's
    counts are known in closed form (tp = 1), so the plan is made from those. "time" measures the
    layers at tp = 1 (`reference_layer_times`) on the first rank of `world` and shares the result.
    Every rank gets the same plan.
    """
    from capstan.pipeline import LayerSpec, partition
    from capstan.pipeline import balanced_bounds as by_weights

    method = cfg.parallel.partition
    if method == "flops":
        return by_weights(reference_layer_flops(cfg), parts)
    if method == "time":
        return by_weights(reference_layer_times(cfg, world), parts)
    stand_ins = [LayerSpec(lambda n=n: _Count(n)) for n in reference_layer_params(cfg)]
    return partition(stand_ins, parts, method).bounds


def _microbatch_tokens(cfg: Config) -> torch.Tensor:
    """A micro-batch of token ids, the first layer's input when a partition counts or times layers."""
    return torch.zeros(cfg.train.micro_batch_size, cfg.model.seq_len, dtype=torch.long)


def reference_layer_times(cfg: Config, world: comm.Group | None = None) -> list[float]:
    """Seconds of forward + backward of each of the reference GPT's ``model.layers`` on a micro-batch,
    at tp = 1, measured on the first rank of `world` and broadcast. The blocks are alike, so one is
    timed and stands for all of them (a 48-block model costs four layers' timing, not fifty)."""
    from capstan.pipeline import LayerSpec, agreed_layer_times
    from capstan.tensorpar import gpt_layer_factories

    f = gpt_layer_factories(reference_gpt_config(cfg), comm.single_process_groups().tp, seed=cfg.train.seed)
    embedding, block, norm, head = agreed_layer_times([LayerSpec(f[0]), LayerSpec(f[1]), LayerSpec(f[-2]),
                                                       LayerSpec(f[-1])], _microbatch_tokens(cfg), world)
    return [embedding, *([block] * cfg.model.n_layers), norm, head]


def user_partition(cfg: Config, specs: Sequence, stages: int,
                   world: comm.Group | None = None):  # -> capstan.pipeline.Partition
    """A user pipeline's plan into stages x virtual_stages parts by ``parallel.partition``; "flops"
    counts on a micro-batch of token ids (the engine's data), on the meta device; "time" times the
    layers on that micro-batch on the first rank of `world`, which shares the timings."""
    from capstan.pipeline import PartitionError, partition

    v = cfg.parallel.virtual_stages
    try:
        return partition(specs, stages * v, cfg.parallel.partition, example=_microbatch_tokens(cfg), group=world)
    except PartitionError as exc:
        raise ValueError(f"parallel.pp * virtual_stages = {stages} * {v}: {exc}") from None


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of [..., vocab] logits: the default loss of a user model."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def user_layer_specs(model: nn.Sequential | Sequence) -> list:
    """The user's pipeline model as LayerSpecs: a list of them as given, one per child of an
    ``nn.Sequential`` (whose factory returns that child: it is already built), or a transformers
    decoder split into embedding / decoder layers / norm + head (capstan.pipeline.hf_layer_specs)."""
    from capstan.pipeline import LayerSpec, hf_layer_specs

    if isinstance(model, nn.Module) and not isinstance(model, nn.Sequential):
        specs = hf_layer_specs(model)
        if specs is not None:
            return specs

    if isinstance(model, nn.Sequential):
        seen: dict[int, str] = {}
        for name, child in model.named_children():
            for p in child.parameters():
                if seen.setdefault(id(p), name) != name:
                    raise ValueError(f"layers {seen[id(p)]!r} and {name!r} of the nn.Sequential share a parameter; "
                                     "stages cannot share it silently: pass a list of capstan.pipeline.LayerSpec "
                                     "with the same `tied` key on both, so their gradients are summed")
        return [LayerSpec(lambda child=child: child, name) for name, child in model.named_children()]
    specs = list(model)
    bad = [i for i, s in enumerate(specs) if not isinstance(s, LayerSpec)]
    if not specs or bad:
        raise TypeError("with parallel.pp > 1 the model must be None (the reference GPT), an nn.Sequential or a "
                        f"non-empty list of capstan.pipeline.LayerSpec; item(s) {bad} are not LayerSpecs"
                        if bad else "with parallel.pp > 1 the model's list of layers is empty")
    return specs


class PipelineStage:
    """This rank's pipeline stage of the reference GPT (see the module docstring)."""

    def __init__(self, cfg: Config, groups: comm.Groups, specs: list | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 device: torch.device | None = None, sliced: bool = False) -> None:
        """specs None: the reference GPT of [model]; else the user's layers (`user_layer_specs`)
        trained with `loss_fn` (outputs, targets) -> mean loss. `device`: where the stage computes.
        sliced: the user's layers are tensor-parallel already (a transformers decoder sliced by its
        family's plan), so tp > 1 is allowed."""
        from capstan.pipeline import LayerSpec, Partition, PipelineExecutor, make_schedule

        p = cfg.parallel
        v = p.virtual_stages
        self.config, self.groups = cfg, groups
        self.device = device or torch.device("cpu")
        self.reference = specs is None
        if self.reference:
            from capstan.tensorpar import gpt_layer_factories, gpt_loss

            m = cfg.model
            gpt = reference_gpt_config(cfg)
            from capstan.tensorpar.context import ContextParallel

            factories = gpt_layer_factories(gpt, groups.tp, seed=cfg.train.seed,
                                            sequence_parallel=p.sequence_parallel,
                                            cp=ContextParallel.of(groups.cp, p.cp_mode))
            names = ["embedding", *(f"block{i}" for i in range(m.n_layers)), "final_norm", "head"]
            specs = [LayerSpec(f, name) for f, name in zip(factories, names, strict=True)]
            self.plan = Partition(tuple(specs), balanced_bounds(cfg, groups.pp.size * v, groups.world), p.partition)
            self._loss_fn = gpt_loss(gpt, groups.tp)
        else:
            if groups.tp.size > 1 and not sliced:
                raise ValueError(f"parallel.tp = {groups.tp.size} with a pipeline of your own layers: only the "
                                 "reference GPT is sliced for tensor parallelism under pp > 1; use tp = 1")
            self.plan = user_partition(cfg, specs, groups.pp.size, groups.world)
            self._loss_fn = loss_fn or token_cross_entropy
        self.schedule = make_schedule(SCHEDULE_NAMES[p.schedule], groups.pp.size,
                                      cfg.train.grad_accum_steps, v)
        self._scale = 1.0
        # The reference's factories seed every parameter themselves (tensorpar's per-layer seeds); a
        # user LayerSpec is built under a seed of its own derived from train.seed and its index, as
        # `initialize` builds the same list at pp = 1, so every layout starts from the same values.
        seed = None if self.reference else cfg.train.seed
        # memory.activation_checkpointing: the reference GPT's blocks recompute themselves (their dropout
        # masks replayed); a user pipeline's stage chunks are checkpointed by the executor.
        ckpt = cfg.memory.activation_checkpointing and not self.reference
        # With chunked memory the reference GPT's stage is built on the meta device and straight into
        # chunks, one layer in RAM at a time (`init_fn`, build.py's LayerwiseInit).
        meta = self.reference and uses_chunks(cfg)
        with_targets = None
        if self.reference:  # the reference GPT's head computes its loss in tiles given the targets
            from capstan.tensorpar.modules.gpt import loss_targets as with_targets
        self.executor = PipelineExecutor(self.plan, self.schedule, groups, self._scaled_loss, seed=seed,
                                         checkpoint=ckpt, meta=meta, device=self.device, with_targets=with_targets)
        self.init_fn = None
        if meta:
            from .models import LayerwiseInit

            mine = [(layer, factories[int(name)]) for chunk in self.executor.chunks
                    for name, layer in chunk.named_children()]
            self.init_fn = LayerwiseInit([m for m, _ in mine], [f for _, f in mine])
        self.activations: object | None = None  # where recomputed blocks' inputs wait (build.activation_keeper)
        if cfg.memory.activation_checkpointing and self.reference:
            from .models import activation_keeper, recompute_blocks

            self.activations = activation_keeper(cfg, groups.world.rank, self.device)
            recompute_blocks((layer for chunk in self.executor.chunks for layer in chunk), self.activations)
        for key, group in self.executor.tied_groups.items():
            if group.rank != 0:  # the lowest stage holding a tied weight counts it in the gradient norm
                setattr(self.executor.tied_params[key], STAGE_COPY_ATTR, True)
        self.module: nn.Module = self.executor.chunks  # this stage's chunks, in virtual-stage order

    @property
    def is_first(self) -> bool:
        return self.groups.pp.rank == 0

    @property
    def is_last(self) -> bool:
        return self.groups.pp.rank == self.groups.pp.size - 1

    def _scaled_loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The loss in fp32 (as Engine.forward); the fp16 loss scale rides on it into backward.
        return self._loss_fn(logits_of(out).float(), targets) * self._scale

    def _share_loss(self, local: float | None) -> float:
        """The last stage's value on every rank of the pipeline group."""
        t = torch.tensor([local if local is not None else 0.0], dtype=torch.float64)
        comm.broadcast(t, src=self.groups.pp.size - 1, group=self.groups.pp)
        return float(t.item())

    def train_step(self, xs: list[torch.Tensor], ys: list[torch.Tensor], loss_scale: float = 1.0) -> float:
        """Forward and backward of all micro-batches; returns their mean loss (unscaled) on every stage.

        Gradients of ``loss_scale`` x the mean loss accumulate into the existing ``.grad``
        (the engine's flat buffer), which the caller zeroes after its optimizer step.
        """
        self._scale = loss_scale
        with autocast(self.config.precision, self.device.type):
            loss = self.executor.step(inputs=xs if self.is_first else None, targets=ys if self.is_last else None,
                                      zero_grad=False)
        return self._share_loss(None if loss is None else loss / loss_scale)

    @torch.no_grad()
    def eval_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Mean loss of one batch: a forward-only pass along the virtual stages, on every stage."""
        from capstan.pipeline.runtime.transport import HEADER_LEN, decode_header, encode_header

        x, y = batch
        pp, stages, sched = self.groups.pp, self.groups.pp.size, self.schedule
        me = pp.rank
        loss: float | None = None
        for v in range(stages * sched.chunks):  # virtual stage v = chunk c of stage v % stages
            if v % stages != me:
                continue
            chunk = v // stages
            if v > 0:  # a header (dtype, shape), then the activation, from the previous virtual stage
                h = torch.zeros(HEADER_LEN, dtype=torch.int64)
                comm.exchange([comm.P2POp("recv", h, (me - 1) % stages)], group=pp).wait()
                shape, dtype = decode_header(h)
                x = torch.empty(shape, dtype=dtype, device=self.device)
                comm.exchange([comm.P2POp("recv", x, (me - 1) % stages)], group=pp).wait()
            with autocast(self.config.precision, self.device.type):
                out = self.module[chunk](x)
            if v == stages * sched.chunks - 1:
                loss = float(self._loss_fn(logits_of(out).float(), y))
            else:
                out = out.contiguous()
                comm.exchange([comm.P2POp("send", encode_header(out), (me + 1) % stages)], group=pp).wait()
                comm.exchange([comm.P2POp("send", out, (me + 1) % stages)], group=pp).wait()
        return self._share_loss(loss)
