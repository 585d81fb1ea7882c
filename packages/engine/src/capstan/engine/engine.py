"""`Engine`: one training step over whatever layout the config asks for.

Two state holders sit behind the same three calls
(``loss = engine(batch); engine.backward(loss); engine.step()``):

* `ZeroOptimizer` (zero/): plain tensors in a flat fp32 buffer, data
  parallelism with ZeRO 0/1/2, tensor parallelism through tensorpar's layers;
* capstan.chunkmem (`ChunkedModel` + `ChunkAdam`): parameters, gradients and
  Adam moments in chunks with a RAM budget and a disk tier; sharded over dp
  (`ShardedChunkedModel`, ZeRO-3) when dp > 1, or replicated on every dp rank
  under 1-bit Adam (`ReplicatedChunkedModel`, `OneBitChunkAdam`, whose
  residuals are chunks too); the gradient norm is weighted
  per (tp-sliced?, decayed?) chunk list and reduced over tp and pp.

With ``parallel.pp > 1`` the model is this rank's `PipelineStage` (pipe.py):
`train_batch` hands the step's ``grad_accum_steps`` micro-batches to the
pipeline schedule as its microbatches, and `ZeroOptimizer` (or the chunked
model, which the executor's calls run through) steps the stage's own
parameters over dp (the gradient norm is summed over the stages).
See docs/parallelism.md for every combination.

`engine.step()` acts only at the end of gradient accumulation; it averages
gradients over dp, computes the global norm, skips the step on an fp16
overflow, clips, and runs AdamW at the scheduled learning rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from capstan import comm
from capstan.comm import faults
from capstan.comm.device import device_module, is_accelerator
from capstan.comm.procmem import peak_rss_bytes

from .config.load import check_states_fit, uses_chunks
from .config.schema import Config
from .outputs import check_batch_convention, loss_of
from .pipe import PipelineStage
from .precision import autocast, loss_scaler
from .schedule_lr import lr_at
from .zero.optimizer import ZeroOptimizer, group_order

__all__ = ["Engine", "StepInfo", "LossFn"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def to_device(batch: object, device: torch.device) -> object:
    """A batch (a tuple / list / dict of tensors) on `device`."""
    if isinstance(batch, torch.Tensor):
        if batch.device.type == "cpu" and is_accelerator(device) and not batch.is_pinned():
            # From pageable memory a copy to a GPU waits for the device; from pinned memory it does not
            # (what DataLoader(pin_memory=True) does).
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
log = comm.get_logger(__name__)


@dataclass
class StepInfo:
    """What one optimizer step did (the metrics of that step)."""

    step: int
    loss: float = float("nan")
    lr: float = 0.0
    grad_norm: float = 0.0
    loss_scale: float = 1.0
    skipped: bool = False
    seconds: float = 0.0
    mem: dict[str, float] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)  # comm.wire_bytes with parallel.compression


GPU_SHARE = 0.9  # of the GPU memory free at start that chunks and activations may use (the rest: CUDA's own)
GPU_WARMUP_SHARE = 5  # the warm-up step keeps chunks within 1/5 of that while it measures the activations


def gpu_chunk_limit(device: torch.device) -> int:
    """Bytes this rank's chunks and activations may use on its device without memory.gpu_budget: 90% of
    what is free at start, shared evenly by the ranks of this node that share the device."""
    module = device_module(device)
    free, _ = module.mem_get_info(device)
    sharing = 1
    if comm.is_initialized():
        local = comm.launch().local_world_size
        sharing = -(-local // max(1, module.device_count()))
    return int(free * GPU_SHARE / sharing)


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Module buffers (causal masks, BatchNorm statistics, rotary caches) where forward runs. Chunked memory
    moves parameters only, so without this a model whose forward reads a buffer mixes a CPU tensor into
    device work on its first step."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)


def _overflowed(names: list[str], shown: int = 3) -> str:
    """The overflow message's tail naming this rank's overflowing parameters (the first `shown`, then
    "and N more"); "" when this rank has none (another rank's gradients overflowed)."""
    if not names:
        return ""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f" (inf/NaN on this rank in the gradients of {', '.join(names[:shown])}{more})"


class Engine:
    """Build with `capstan.engine.initialize`; see the module docstring and docs/engine.md."""

    def __init__(self, *, config: Config, model: nn.Module, groups: comm.Groups, loss_fn: LossFn,
                 pipeline: PipelineStage | None = None, reference_model: bool = False,
                 init_fn: Callable[[nn.Module], None] | None = None, device: torch.device | None = None) -> None:
        self.config, self.groups, self.loss_fn = config, groups, loss_fn
        self.reference_model = reference_model
        self.hf_source: dict | None = None  # a transformers model's config and class (build.hf_source)
        # recomputed blocks' inputs: offloaded or counted (chunkmem.ActivationOffload; build.activation_keeper)
        self.activations: object | None = None
        self._heads: list[nn.Module] | None = None  # the reference GPT's head on this rank (its logits' bytes)
        # Where forward and backward run (models.resolve_device); chunks move there when they compute.
        self.device = device or torch.device("cpu")
        self.pipeline = pipeline  # with pp > 1: this rank's stage; `model` is then its chunks
        self.accum = config.train.grad_accum_steps
        self.global_step = 0  # optimizer steps taken
        self.micro_step = 0  # backward passes since the last optimizer step
        self.scaler = loss_scaler(config.precision) if config.precision.dtype == "fp16" else None
        self.chunked = uses_chunks(config)
        from capstan.tensorpar.context import ContextParallel

        # cp > 1: each rank of a cp group takes its tokens of every sequence (tensorpar/context.py)
        self.context = ContextParallel.of(groups.cp, config.parallel.cp_mode)
        # each micro-batch's loss, kept on its device until the step reads them all at once
        self._micro_losses: list[torch.Tensor | float] = []
        self._batch_checked = False
        self._step_start: float | None = None
        self._disk_peak = 0
        if self.chunked:
            self._init_chunks(model, init_fn)
        else:
            self.module = model.to(self.device)  # parameters, and so the flat buffers and Adam, on the device
            bucket_bytes = int(config.parallel.bucket_mb * 2**20)
            overlap = config.parallel.overlap_param_gather
            if overlap is None:  # auto: on for the reference GPT, whose parameters are used by their own modules
                overlap = reference_model
            gather_bytes = int(config.parallel.bucket_mb * 2**20) if overlap else 0
            # Under pp one schedule runs every micro-batch's backward, then after_backward: a bucket
            # starts once its parameters got all their micro-batches' gradients, during the schedule's
            # last backwards; tied weights wait for the schedule's sum over their stages.
            micro, late = (self.accum, list(pipeline.executor.tied_params.values())) if pipeline else (0, [])
            p = config.parallel
            # Compression acts on the dp (x cp) axis: with one replica there is nothing to send.
            compression = p.compression if groups.replicas.size > 1 else "none"
            self.optimizer = ZeroOptimizer(model, groups, p.zero_stage, config.train, bucket_bytes,
                                           p.zero2_collective, gather_bytes, micro, late,
                                           compression=compression, freeze_steps=p.compression_freeze_steps)
            comm.reset_wire_bytes()
            # state_dict() between steps must see every rank's updated parameters.
            model.register_state_dict_pre_hook(lambda *args, **kwargs: self.optimizer.wait_params())

    def _init_chunks(self, model: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> None:
        """Model states into chunkmem; a meta-device `model` is materialized module by module into its
        chunks (by `init_fn`, else each module's reset_parameters)."""
        from capstan.chunkmem import (
            AdamGroup,
            ChunkAdam,
            ChunkedModel,
            ChunkManager,
            DiskStore,
            OneBitChunkAdam,
            ReplicatedChunkedModel,
            ShardedChunkedModel,
        )

        mem, t = self.config.memory, self.config.train
        if mem.offload == "cpu" and mem.cpu_budget is not None and not self.reference_model:
            # (the config check sized the reference GPT; this is the model being trained)
            check_states_fit(mem.cpu_budget, sum(p.numel() for p in model.parameters() if p.requires_grad))
        rank = self.groups.world.rank
        disk = DiskStore(mem.disk_dir, rank=rank) if mem.offload == "disk" else None
        # On a GPU, parameter (and gradient) chunks compute there within memory.gpu_budget; masters and
        # Adam moments stay in RAM / on disk, where the native CPU Adam steps them (chunkmem/memory/device.py).
        gpu = self.device if is_accelerator(self.device) else None
        budget, limit, measure = (mem.gpu_budget, None, None) if gpu is not None else (None, None, None)
        if gpu is not None and budget is None:  # derived from the GPU and the activations the warm-up measures
            from capstan.chunkmem.memory.device import device_peak

            limit = gpu_chunk_limit(gpu)
            budget, measure = limit // GPU_WARMUP_SHARE, device_peak(gpu).moment
        self.manager = ChunkManager(mem.cpu_budget, disk, eviction=mem.eviction, memory_limit=mem.ram_limit,
                                    device=gpu, device_budget=budget, device_limit=limit, device_measure=measure)
        named = dict(model.named_parameters())
        names = [n for n, p in named.items() if p.requires_grad]
        # One chunk list per (tp-sliced?, decayed?), as zero/optimizer.py's segments: each list has one set of
        # Adam hyper-parameters and one weight in the global gradient norm. Replicated parameters
        # (tp_dim None: identical on every tp rank) count on tp rank 0 only, sliced ones on every
        # tp rank; the sum then runs over tp and pp (stages hold disjoint parameters).
        # A tied weight's copy on a higher pipeline stage (zero.is_stage_copy) gets weight 0 in the norm.
        param_groups, adam, weights = [], [], []
        classes: dict[tuple[bool, bool, bool], list[str]] = {}
        for n in names:
            classes.setdefault(group_order(named[n]), []).append(n)
        for key in sorted(classes):  # the flat buffer's order (zero/optimizer.py group_order)
            replicated, no_decay, copy = key
            sliced, decay = not replicated, not no_decay
            param_groups.append(classes[key])
            adam.append(AdamGroup(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                  weight_decay=t.weight_decay if decay else 0.0))
            weights.append(1.0 if (sliced or self.groups.tp.rank == 0) and not copy else 0.0)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.config.precision.dtype]
        kwargs = dict(param_groups=param_groups, dtype=dtype, accumulate_grads=self.accum > 1,
                      norm_weights=weights, outer_groups=(self.groups.tp, self.groups.pp), init_fn=init_fn)
        if mem.chunk_order == "trace":  # one forward on a dummy batch of token ids decides the packing order
            tokens = self.config.model.seq_len // self.groups.cp.size  # this rank's tokens under cp
            dummy = torch.zeros(t.micro_batch_size, tokens, dtype=torch.long)
            kwargs.update(order="trace", example_inputs=(dummy,))
        overlap = self._overlap_optimizer()
        p, replicas = self.config.parallel, self.groups.replicas
        if replicas.size > 1 and p.compression == "onebit":  # every rank the whole momentum: replicated chunks
            self.module = ReplicatedChunkedModel(model, self.manager, mem.chunk_size, group=replicas, onebit=True,
                                                 **kwargs)
            self.optimizer = OneBitChunkAdam(self.module, groups=adam, freeze_steps=p.compression_freeze_steps)
        else:
            if replicas.size > 1:  # ZeRO-3 through chunks: each dp (x cp) rank owns 1/dp of them
                self.module = ShardedChunkedModel(model, self.manager, mem.chunk_size, group=replicas,
                                                  quantized=p.compression == "int8", **kwargs)
            else:
                self.module = ChunkedModel(model, self.manager, mem.chunk_size, report_grads=overlap, **kwargs)
            self.optimizer = ChunkAdam(self.module, groups=adam, overlap=overlap)
        comm.reset_wire_bytes()
        self._stepping = False
        if gpu is not None:
            buffers_to(model, gpu)

    def _overlap_optimizer(self) -> bool:
        """memory.overlap_optimizer: on where asked (and possible), by default where chunks compute on a GPU."""
        from .config import ConfigError

        mem = self.config.memory
        why = None
        if self.groups.replicas.size > 1 and self.config.parallel.compression == "onebit":
            why = "1-bit Adam averages the momentum after backward"
        elif self.groups.replicas.size > 1:
            why = (f"dp = {self.groups.replicas.size} shards the chunks (ZeRO-3), and sharded gradients reach their "
                   "owners late")
        elif mem.cpu_budget is not None or mem.offload == "disk":
            why = "chunks move between RAM and disk (memory.cpu_budget or offload = \"disk\")"
        elif self.pipeline is not None and self.pipeline.executor.tied_params:
            why = "weights tied across pipeline stages get their gradients summed after backward"
        if mem.overlap_optimizer and why is not None:
            raise ConfigError(f"memory.overlap_optimizer = true cannot overlap the step here: {why}")
        if mem.overlap_optimizer is None:
            return why is None and is_accelerator(self.device)
        return bool(mem.overlap_optimizer)

    def _arm_overlap(self, arrivals: int = 1) -> None:
        """Before the backward that completes this step's gradients: the overlapped optimizer steps each
        chunk group as its gradients complete, with this step's learning rate, clip and loss scale."""
        if not (self.chunked and self.optimizer.speculation is not None):
            return
        lr = lr_at(self.config.train, self.global_step)
        for group in self.optimizer.groups:
            group.lr = lr
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self.optimizer.arm(grad_clip=self.config.train.grad_clip or None, loss_scale=scale,
                           check_overflow=self.scaler is not None, arrivals=arrivals)

    # ---- the three-call API ------------------------------------------------------------------------
    def forward(self, batch: tuple[torch.Tensor, torch.Tensor] | Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss of one micro-batch: (inputs, targets), each [micro, seq_len], or a dict of tensors
        passed to the model as keywords (outputs.py: Hugging Face models and batches as they are)."""
        if self.pipeline is not None:
            raise RuntimeError("with parallel.pp > 1 the pipeline schedule runs all micro-batches of a step: "
                               "use engine.train_batch / engine.eval_batch, not engine(batch) / backward")
        if torch.is_grad_enabled() and self._step_start is None:  # eval passes are not part of a step
            self._step_start = time.perf_counter()
            if self.chunked and not self._stepping:
                self.manager.begin_step()
                self._stepping = True
        faults.crash_point("forward", step=self.global_step + 1)
        self._check_first_batch(batch, pipelined=False)
        batch = self.tokens_of_this_rank(to_device(batch, self.device))
        with autocast(self.config.precision, self.device.type), self._targets_of(batch):
            return loss_of(self.module, batch, self.loss_fn)

    __call__ = forward

    def _check_first_batch(self, batch: object, pipelined: bool) -> None:
        """The batch conventions, checked on the first micro-batch only (outputs.check_batch_convention)."""
        if not self._batch_checked:
            check_batch_convention(batch, pipelined)
            self._batch_checked = True

    def _targets_of(self, batch: object) -> AbstractContextManager[None]:
        """The reference GPT's head computes its loss in tiles when it knows the targets (memory.tiled_loss;
        tensorpar.gpt.loss_targets); any other model runs as it is."""
        if not (self.reference_model and isinstance(batch, (tuple, list)) and len(batch) == 2):
            return nullcontext()
        from capstan.tensorpar.gpt import loss_targets
        return loss_targets(batch[1])

    def tokens_of_this_rank(self, batch: object) -> object:
        """With context parallelism, this rank's tokens of a batch of whole sequences (inputs and targets
        alike, along the sequence); else the batch as it is."""
        if self.context is None or not isinstance(batch, (tuple, list)):
            return batch
        return type(batch)(self.context.shard(t) if isinstance(t, torch.Tensor) else t for t in batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, scaled for accumulation (and fp16 loss scaling)."""
        self._micro_losses.append(loss.detach())  # read at the step's end: no host sync per micro-batch
        scaled = loss / self.accum
        if self.scaler is not None:
            scaled = scaled * self.scaler.scale
        if faults.armed("backward") and scaled.requires_grad:  # inside autograd, at its first node
            step = self.global_step + 1
            scaled.register_hook(lambda g: faults.crash_point("backward", step=step))
        if self.chunked:
            if self.micro_step == self.accum - 1:  # this backward completes the step's gradients
                self._arm_overlap()
            self.module.backward(scaled)
        else:
            scaled.backward()
            self.optimizer.after_backward()
        self.micro_step += 1

    def step(self) -> StepInfo | None:
        """The optimizer step once `grad_accum_steps` backwards are in; None before that."""
        if self.micro_step < self.accum:
            return None
        if self.micro_step > self.accum:
            raise RuntimeError(f"{self.micro_step} backward calls since the last step, but "
                               f"train.grad_accum_steps = {self.accum}")
        t = self.config.train
        info = StepInfo(step=self.global_step + 1, lr=lr_at(t, self.global_step))
        faults.crash_point("optimizer.step", step=info.step)
        info.loss = self._global_loss()
        if self.chunked:
            self._chunk_step(info)
        else:
            self._flat_step(info)
        self.global_step += 1
        self.micro_step = 0
        self._micro_losses = []
        info.seconds = time.perf_counter() - (self._step_start or time.perf_counter())
        self._step_start = None
        info.mem = self.memory_stats()
        if self.config.parallel.compression != "none":  # what this rank sent through compressed collectives
            info.comm = {"comm.wire_bytes": comm.reset_wire_bytes()}
        return info

    def _global_loss(self) -> float:
        """Mean over micro-batches and dp (x cp) ranks: equal-sized micro-batches (and sequence shards) make it
        the global mean."""
        kept = [x for x in self._micro_losses if isinstance(x, torch.Tensor)]
        total = sum(x for x in self._micro_losses if not isinstance(x, torch.Tensor))
        if kept:  # one host read for all of them (a sum of a few fp32 values in fp64 is exact in any order)
            total += float(torch.stack([x.reshape(()).double() for x in kept]).sum())
        local = torch.tensor([total / len(self._micro_losses)], dtype=torch.float64)
        comm.all_reduce(local, op="avg", group=self.groups.replicas)
        return float(local.item())

    def _flat_step(self, info: StepInfo) -> None:
        opt, t = self.optimizer, self.config.train
        opt.reduce_gradients()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        info.loss_scale = scale
        if self.scaler is not None and opt.has_overflow():
            where = _overflowed(opt.nonfinite_params())
            self._update_scale(True, info.step, where)
            info.skipped, info.grad_norm = True, float("inf")
            log.info("step %d: fp16 gradients overflowed at loss scale %g%s; step skipped", info.step, scale, where)
            opt.zero_grad()
            return
        norm = opt.grad_norm() / scale
        info.grad_norm = norm
        clip = 1.0
        if t.grad_clip and norm > t.grad_clip:
            clip = t.grad_clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
        opt.step(info.lr, clip / scale)
        opt.zero_grad()
        if self.scaler is not None:
            self.scaler.update(False)

    def _update_scale(self, overflow: bool, step: int, where: str = "") -> None:
        """The loss scaler's update; an overflow at the minimum scale stops the run naming the step (and,
        `where`, the layers that overflowed on this rank). Every rank agrees on `overflow` (reduced over
        dp, tp and pp), so every rank raises together."""
        from capstan.chunkmem import LossScaleError

        try:
            self.scaler.update(overflow)
        except LossScaleError as exc:
            raise LossScaleError(f"step {step}: {exc}{where}") from None

    def _chunk_step(self, info: StepInfo) -> None:
        for group in self.optimizer.groups:
            group.lr = info.lr
        scale = self.scaler.scale if self.scaler is not None else 1.0
        info.loss_scale = scale
        clip = self.config.train.grad_clip or None
        if clip is None and not self.optimizer.armed:  # (the overlapped step returns the norm itself)
            info.grad_norm = self.optimizer.grad_norm() / scale
        norm, overflow = self.optimizer.step(grad_clip=clip, loss_scale=scale,
                                             check_overflow=self.scaler is not None)
        if norm is not None:
            info.grad_norm = float(norm)
        where = _overflowed(self.optimizer.overflowed) if overflow else ""
        if self.scaler is not None:
            self._update_scale(overflow, info.step, where)
        if overflow:
            info.skipped, info.grad_norm = True, float("inf")
            log.info("step %d: fp16 gradients overflowed at loss scale %g%s; step skipped", info.step, scale, where)
        self.manager.end_step()
        self._stepping = False

    # ---- loops ------------------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> StepInfo:
        """One optimizer step over the next `grad_accum_steps` micro-batches of `data_iter`."""
        self.module.train()
        if self.micro_step:
            raise RuntimeError("train_batch called in the middle of a manual accumulation")
        if self.pipeline is not None:
            self._pipeline_micro_batches(data_iter)
        else:
            for _ in range(self.accum):
                self.backward(self(next(data_iter)))
        info = self.step()
        assert info is not None
        return info

    def _pipeline_micro_batches(self, data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """All micro-batches through the pipeline schedule: what `accum` forward/backward calls do at pp = 1."""
        assert self.pipeline is not None
        self._step_start = time.perf_counter()
        # Every stage reads alike; the first uses the inputs, the last the targets.
        read = [next(data_iter) for _ in range(self.accum)]
        self._check_first_batch(read[0], pipelined=True)  # every rank, before the schedule's first transfer
        batches = [self.tokens_of_this_rank(to_device(b, self.device)) for b in read]
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.chunked:
            # The executor calls this stage's modules itself, so the chunk hooks fetch parameters;
            # the saved-tensor hooks must be active around its forwards, and the end of backward
            # (release, gradient reductions of sharded chunks) runs once after its last backward.
            if not self._stepping:
                self.manager.begin_step()
                self._stepping = True
            self._arm_overlap(arrivals=self.accum)  # one schedule runs every micro-batch's backward
            with self.module.saved_tensors():
                loss = self.pipeline.train_step([x for x, _ in batches], [y for _, y in batches], scale)
            self.module.finish_backward()
        else:
            loss = self.pipeline.train_step([x for x, _ in batches], [y for _, y in batches], scale)
            self.optimizer.after_backward()  # gradients of the whole mean loss are in the flat buffer
        self._micro_losses = [loss]  # the mean over the micro-batches, shared by the last stage
        self.micro_step = self.accum

    @torch.no_grad()
    def eval_batch(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over `batches` (this rank's share), averaged over dp: the validation loss."""
        self.module.eval()
        # between steps: chunk accesses stay out of the trace and leave the moment at the next step's start
        with self.manager.off_trace() if self.chunked else nullcontext():
            if self.pipeline is not None:
                batches = list(batches)
                for batch in batches[:1]:
                    check_batch_convention(batch, pipelined=True)  # a dict is refused on every rank
                losses = [self.pipeline.eval_loss(self.tokens_of_this_rank(to_device(batch, self.device)))
                          for batch in batches]
            else:
                losses = [float(self(batch)) for batch in batches]
        self.module.train()
        local = torch.tensor([sum(losses) / max(1, len(losses))], dtype=torch.float64)
        comm.all_reduce(local, op="avg", group=self.groups.replicas)
        return float(local.item())

    # ---- reporting ----------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, float]:
        """`mem.<tier>.peak_bytes` and `mem.moved_bytes` (from chunkmem when chunked), and the activations
        kept for backward by kind (`_activation_stats`)."""
        return {**self._model_state_stats(), **self._activation_stats()}

    def _activation_stats(self) -> dict[str, float]:
        """`mem.act.*`: the largest this step's recomputed-block inputs held in memory and offloaded at any
        moment, the bytes offloaded so far, and the head's logits (per tile where the loss is tiled)."""
        out: dict[str, float] = {}
        if self.activations is not None:
            s = self.activations.stats()  # type: ignore[attr-defined]
            self.activations.reset_peak()  # type: ignore[attr-defined]
            out.update({"mem.act.block_inputs_peak_bytes": s["held_peak_bytes"],
                        "mem.act.offloaded_peak_bytes": s["offloaded_peak_bytes"],
                        "mem.act.offloaded_total_bytes": s["moved_bytes"]})
        if self._heads is None:
            from capstan.tensorpar.gpt import GPTHead
            self._heads = [m for m in self.module.modules() if isinstance(m, GPTHead)] if self.reference_model else []
        if self._heads:
            out["mem.act.logits_peak_bytes"] = max(head.take_logits_peak() for head in self._heads)
        return out

    def _model_state_stats(self) -> dict[str, float]:
        if not self.chunked:
            held = self.optimizer.state_bytes()  # fixed-size buffers: held is also the peak
            tier = self.device.type  # the model states live where the model computes
            out = {f"mem.{tier}.peak_bytes": held, f"mem.{tier}.resident_bytes": held, "mem.moved_bytes": 0,
                   "mem.process.rss_peak_bytes": peak_rss_bytes()}
            return {**out, **self._device_allocator_stats()}
        s = self.manager.stats()
        disk = s["disk"]["resident_bytes"]  # type: ignore[index]
        self._disk_peak = max(self._disk_peak, disk)
        rss = {"mem.process.rss_peak_bytes": peak_rss_bytes()}
        out = {"mem.cpu.peak_bytes": s["cpu"]["peak_bytes"],  # type: ignore[index]
               "mem.cpu.resident_bytes": s["cpu"]["resident_bytes"],  # type: ignore[index]
               "mem.disk.peak_bytes": self._disk_peak, "mem.disk.resident_bytes": disk,
               "mem.moved_bytes": s["moved_bytes"], "mem.stall_s": s["stall_s"], **rss}  # type: ignore[dict-item]
        if self.device.type in s:  # chunks on the GPU (their bytes, within memory.gpu_budget)
            t = self.device.type
            out[f"mem.{t}.peak_bytes"] = s[t]["peak_bytes"]  # type: ignore[index]
            out[f"mem.{t}.resident_bytes"] = s[t]["resident_bytes"]  # type: ignore[index]
        return {**out, **self._device_allocator_stats()}

    @property
    def disk_peak(self) -> int:
        """The most bytes this rank's disk tier held at a step's end (0 without one)."""
        return self._disk_peak

    def _device_allocator_stats(self) -> dict[str, float]:
        """What torch's caching allocator reserved on this rank's device (activations, fragmentation and
        cache included), peak since the last call; read through chunkmem's `device_peak`, which also feeds
        the manager's per-moment measure, so neither resets the counter under the other."""
        if not is_accelerator(self.device):
            return {}
        from capstan.chunkmem.memory.device import device_peak

        return {f"mem.{self.device.type}.reserved_peak_bytes": device_peak(self.device).step()}

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of this rank's parameters by name (loads chunks one at a time when chunked)."""
        if self.chunked:
            return self.module.state_tensors()
        self.optimizer.wait_params()
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    # ---- checkpoints (checkpoint/) ----------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Save a universal checkpoint of this step under `directory` (every rank calls it)."""
        from . import checkpoint

        return checkpoint.save(self, directory)

    def load(self, path: str | Path) -> int:
        """Load a checkpoint saved under any layout (a step directory, or the newest under `path`); returns its step."""
        from . import checkpoint

        return checkpoint.load(self, path)

    def close(self) -> None:
        if self.activations is not None:
            self.activations.close()  # type: ignore[attr-defined]
        if self.chunked:
            if self.optimizer.speculation is not None:
                self.optimizer.speculation.close()
            self.manager.close()
