"""`Engine`: one training step over whatever layout the config asks for.

Two holders of the model states sit behind the same three calls
(``loss = engine(batch); engine.backward(loss); engine.step()``), both behind
one interface, `states.ModelStates` (``engine.states``):

* `FlatStates` (states/flat.py, `ZeroOptimizer` in zero/): plain tensors,
  the optimizer's fp32 states in a flat buffer, data parallelism with ZeRO
  0/1/2, tensor parallelism through tensorpar's layers;
* `ChunkedStates` (states/chunked.py, capstan.chunkmem's `ChunkedModel` +
  `ChunkAdam`): parameters, gradients and Adam moments in chunks with a RAM
  budget and a disk tier; sharded over dp (`ShardedChunkedModel`, ZeRO-3)
  when dp > 1, or replicated on every dp rank under 1-bit Adam
  (`ReplicatedChunkedModel`, `OneBitChunkAdam`); the gradient norm is
  weighted per (tp-sliced?, decayed?) chunk list and reduced over tp and pp.

The engine runs the calls, the loss, the pipeline schedule, loss scaling and
the reports; nothing in it depends on which holder it has.

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
from capstan.comm.health import faults
from capstan.comm.job.accelerator import is_accelerator

from .config.load import uses_chunks
from .config.schema import Config
from .model.outputs import check_batch_convention, loss_of
from .model.pipe import PipelineStage
from .precision import autocast, loss_scaler
from .schedule_lr import lr_at
from .states import ChunkedStates, FlatStates, ModelStates

__all__ = ["Engine", "StepInfo", "LossFn"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def to_device(batch: object, device: torch.device) -> object:
    """A batch (a tuple / list / dict of tensors) on `device`."""
    if isinstance(batch, torch.Tensor):
        if batch.device.type == "cpu" and is_accelerator(device) and not batch.is_pinned():
            # From pageable memory a copy to a GPU waits for the device; from pinned memory it does not
            # (what DataLoader(pin_memory=True) does). Contiguous first: a strided view (inputs cut from
            # a token block) would be copied to pageable memory again on its way, waiting all the same.
            batch = batch.contiguous().pin_memory()
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
        from capstan.tensorpar.context import ContextParallel

        # cp > 1: each rank of a cp group takes its tokens of every sequence (tensorpar/context.py)
        self.context = ContextParallel.of(groups.cp, config.parallel.cp_mode)
        # each micro-batch's loss, kept on its device until the step reads them all at once
        self._micro_losses: list[torch.Tensor | float] = []
        self._batch_checked = False
        self._step_start: float | None = None
        # The parameters, gradients and optimizer states, and everything that depends on where they live.
        self.states: ModelStates = (
            ChunkedStates(model, config, groups, self.device, pipeline, init_fn)
            if uses_chunks(config) else FlatStates(model, config, groups, self.device, pipeline, reference_model))

    @property
    def chunked(self) -> bool:
        """Whether the model states are chunkmem's (memory.offload or ZeRO-3) rather than flat buffers."""
        return self.states.chunked

    @property
    def module(self) -> nn.Module:
        """What forward runs: the model, or its chunked wrapper."""
        return self.states.module

    @property
    def optimizer(self) -> object:
        return self.states.optimizer

    @property
    def manager(self) -> object:
        """The chunk manager of chunked states (an AttributeError for flat ones, which have none)."""
        if not isinstance(self.states, ChunkedStates):
            raise AttributeError("this engine's model states are flat buffers: no chunk manager")
        return self.states.manager

    def _scale(self) -> float | None:
        """The fp16 loss scale; None without loss scaling (the states' convention)."""
        return self.scaler.scale if self.scaler is not None else None

    # ---- the three-call API ------------------------------------------------------------------------
    def forward(self, batch: tuple[torch.Tensor, torch.Tensor] | Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss of one micro-batch: (inputs, targets), each [micro, seq_len], or a dict of tensors
        passed to the model as keywords (outputs.py: Hugging Face models and batches as they are)."""
        if self.pipeline is not None:
            raise RuntimeError("with parallel.pp > 1 the pipeline schedule runs all micro-batches of a step: "
                               "use engine.train_batch / engine.eval_batch, not engine(batch) / backward")
        if torch.is_grad_enabled() and self._step_start is None:  # eval passes are not part of a step
            self._step_start = time.perf_counter()
            self.states.begin_step()
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
        tensorpar.modules.gpt.loss_targets); any other model runs as it is."""
        if not (self.reference_model and isinstance(batch, (tuple, list)) and len(batch) == 2):
            return nullcontext()
        from capstan.tensorpar.modules.gpt import loss_targets
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
        scaled = loss / self.accum if self.accum > 1 else loss  # (x / 1 is x: two launches a step fewer on a GPU)
        if self.scaler is not None:
            scaled = scaled * self.scaler.scale
        if faults.armed("backward") and scaled.requires_grad:  # inside autograd, at its first node
            step = self.global_step + 1
            scaled.register_hook(lambda g: faults.crash_point("backward", step=step))
        completes = self.micro_step == self.accum - 1  # this backward completes the step's gradients
        self.states.backward(scaled, completes, lr_at(self.config.train, self.global_step), self._scale())
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
        self.states.step(info, self._scale(), self._update_scale)
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

    def _update_scale(self, overflow: bool, step: int, where: str = "") -> None:
        """The loss scaler's update; an overflow at the minimum scale stops the run naming the step (and,
        `where`, the layers that overflowed on this rank). Every rank agrees on `overflow` (reduced over
        dp, tp and pp), so every rank raises together."""
        from capstan.chunkmem import LossScaleError

        try:
            self.scaler.update(overflow)
        except LossScaleError as exc:
            raise LossScaleError(f"step {step}: {exc}{where}") from None

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
        scale = self._scale()
        loss = self.states.pipeline_step(
            lambda: self.pipeline.train_step([x for x, _ in batches], [y for _, y in batches],  # type: ignore[union-attr]
                                             scale if scale is not None else 1.0),
            self.accum, lr_at(self.config.train, self.global_step), scale)
        self._micro_losses = [loss]  # the mean over the micro-batches, shared by the last stage
        self.micro_step = self.accum

    @torch.no_grad()
    def eval_batch(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over `batches` (this rank's share), averaged over dp: the validation loss."""
        self.module.eval()
        # between steps: chunk accesses stay out of the trace and leave the moment at the next step's start
        with self.states.eval_context():
            if self.pipeline is not None:
                batches = list(batches)
                for batch in batches[:1]:
                    check_batch_convention(batch, pipelined=True)  # a dict is refused on every rank
                losses = [self.pipeline.eval_loss(self.tokens_of_this_rank(to_device(batch, self.device)))
                          for batch in batches]
            else:  # each loss stays on the device until all are in: one host read, not one a batch
                held = [self(batch).detach().float().reshape(()) for batch in batches]
                losses = torch.stack(held).tolist() if held else []
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
            from capstan.tensorpar.modules.gpt import GPTHead
            self._heads = [m for m in self.module.modules() if isinstance(m, GPTHead)] if self.reference_model else []
        if self._heads:
            out["mem.act.logits_peak_bytes"] = max(head.take_logits_peak() for head in self._heads)
        return out

    def _model_state_stats(self) -> dict[str, float]:
        return {**self.states.stats(self.device), **self._device_allocator_stats()}

    @property
    def disk_file_bytes(self) -> int:
        """The bytes of this rank's disk tier's file: every chunk's slot and the second slots a guessed step
        wrote (chunkmem's DiskStore); what the run takes on disk, and what `capstan plan` predicts."""
        return self.states.disk_file_bytes()

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
        return self.states.parameters_snapshot()

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
        self.states.close()
