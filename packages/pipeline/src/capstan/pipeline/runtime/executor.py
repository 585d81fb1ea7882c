"""Run a schedule's instructions on this rank's stage, through a table of handlers.

`PipelineExecutor(partition, schedule, groups, loss_fn)` builds only this
stage's chunks (parts ``c * stages + stage`` of the partition), ties shared
weights, and `step(inputs, targets)` runs one training step: every
instruction of ``schedule.steps(stage)`` goes to its handler; every run of
consecutive send/recv instructions is posted as one `comm.exchange`, waited
on at once when it receives anything and left pending when it only sends
(the simulator in simulate.py proves these rules deadlock-free for the
schedules shipped here).

- Loss: computed on the last virtual stage per microbatch, scaled by
  1/microbatches so that accumulated gradients equal those of the whole batch.
- Tied weights: every stage holding a layer with tied key K keeps its own
  copy; at construction the first owner's value is broadcast, and
  `ReduceTiedGrads` sums the copies' gradients over a group of the owners.
- Checkpointing: each chunk's forward runs under torch.utils.checkpoint (no
  stored intermediates, recomputed during backward).
- Failures: any error while running an instruction, and every `comm.CommError`
  (a dead or silent neighbour, within the comm timeout), is raised as
  `PipelineError` naming this stage, the instruction and the lost stage.

Example (every rank of a pp=2 job)::

    groups = comm.build_groups(comm.Topology(pp=2))
    plan = partition(gpt_specs(tied=True), 2, "parameters")
    ex = PipelineExecutor(plan, OneFOneB(2, 8), groups, gpt_loss, seed=0, checkpoint=True)
    loss = ex.step(inputs=micro_x if first else None, targets=micro_y if last else None)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from capstan import comm
from capstan.comm.health import faults

from ..schedule.instructions import (
    Backward,
    CommInstruction,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from ..schedule.schedules import Schedule
from ..schedule.simulate import batches
from ..stages.partition import Partition, tie_layers
from .transport import HEADER_LEN, decode_header, encode_header, shape_key, subgroups

__all__ = ["PipelineExecutor", "PipelineError"]


class PipelineError(RuntimeError):
    """A pipeline step failed on this stage; names the stage, instruction and lost stage(s)."""

    def __init__(
        self, stage: int, instruction: str, detail: str, lost_stages: Sequence[int] = ()
    ) -> None:
        self.stage, self.instruction, self.lost_stages = stage, instruction, list(lost_stages)
        lost = f"; lost stage(s) {self.lost_stages}" if self.lost_stages else ""
        super().__init__(f"pipeline stage {stage} failed at {instruction}{lost}: {detail}")


class PipelineExecutor:
    def __init__(
        self,
        partition: Partition,
        schedule: Schedule,
        groups: comm.Groups,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        seed: int | None = None,
        checkpoint: bool = False,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        meta: bool = False,
        device: torch.device | str = "cpu",
        with_targets: Callable[[torch.Tensor], AbstractContextManager[None]] | None = None,
    ) -> None:
        if groups.pp.size != schedule.stages:
            raise ValueError(
                f"schedule has {schedule.stages} stages but the pipeline group has {groups.pp.size}"
            )
        if partition.parts != schedule.virtual_stages:
            raise ValueError(
                f"partition has {partition.parts} parts; {schedule!r} needs stages x chunks "
                f"= {schedule.virtual_stages}"
            )
        self.schedule, self.groups, self.pp, self.loss_fn = schedule, groups, groups.pp, loss_fn
        # with_targets(targets): a context the last virtual stage's forward runs in (a head that computes
        # its loss itself, in tiles: tensorpar's loss_targets); also around its recomputation
        self.with_targets = with_targets
        self.stage, self.checkpoint = groups.pp.rank, checkpoint
        self.device = torch.device(device)  # where activations live (received ones are allocated there)
        self.parts = partition.stage_parts(self.stage, schedule.stages)
        if meta:  # structure only: the caller gives the parameters values (e.g. straight into chunks)
            if partition.tied_parts():
                raise ValueError("meta=True with weights tied across layers: their first values are "
                                 "broadcast between stages when the executor is built")
            with torch.device("meta"):
                self.chunks = nn.ModuleList(partition.build(part, seed) for part in self.parts)
        else:
            self.chunks = nn.ModuleList(partition.build(part, seed) for part in self.parts).to(self.device)
        self._tie(partition)
        # A separate communicator for shape headers (see transport.py); created collectively.
        self.header_group = subgroups(groups, {"all": list(range(self.pp.size))}, "pp-header")[
            "all"
        ]
        self.optimizer = optimizer_factory(self.chunks.parameters()) if optimizer_factory else None
        self.handlers: dict[type[Instruction], Callable] = {
            LoadMicrobatch: self._load,
            Forward: self._forward,
            Backward: self._backward,
            ReduceTiedGrads: self._reduce_tied,
            OptimizerStep: self._optimizer_step,
        }
        self._shape_key: int | None = None
        self._act_meta: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}
        self.times: dict[str, float] = {}

    # ---- construction
    def _tie(self, partition: Partition) -> None:
        """Share tied weights inside this stage; group the stages that hold copies of one."""
        specs = partition.specs
        mine = [
            (specs[int(name)], layer)
            for chunk in self.chunks
            for name, layer in chunk.named_children()
        ]
        tie_layers([s for s, _ in mine], [m for _, m in mine])
        stages_of = {
            key: sorted({p % self.schedule.stages for p in parts})
            for key, parts in partition.tied_parts().items()
        }
        # Every rank takes part in creating every tied group, owner or not (torch's rule).
        self.tied_groups = subgroups(
            self.groups, {k: v for k, v in stages_of.items() if len(v) > 1}, "tied"
        )
        self.tied_params: dict[str, nn.Parameter] = {}
        for spec, layer in mine:
            if spec.tied in self.tied_groups:
                self.tied_params[spec.tied] = getattr(layer, spec.tied_attr)
        for key, group in sorted(self.tied_groups.items()):
            with torch.no_grad():
                comm.broadcast(self.tied_params[key].data, src=0, group=group)

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.chunks.parameters()

    # ---- one step
    def step(
        self,
        inputs: Sequence[torch.Tensor] | None = None,
        targets: Sequence[torch.Tensor] | None = None,
        *,
        zero_grad: bool = True,
    ) -> float | None:
        """One training step over all microbatches; the mean loss on the last stage, else None.

        inputs: the microbatches' inputs, needed on the stage holding the first virtual stage.
        targets: their targets, needed on the stage holding the last virtual stage.
        Gradients are zeroed first (set to None) and, without an optimizer, left in the
        parameters' .grad. ``zero_grad=False`` accumulates into the existing ``.grad`` instead,
        for a caller that owns the gradient buffers (capstan.engine's flat ZeRO buffer).
        """
        m = self.schedule.microbatches
        for what, data, needed in (
            ("inputs", inputs, self._holds(first=True)),
            ("targets", targets, self._holds(first=False)),
        ):
            if needed and (data is None or len(data) != m):
                got = "none" if data is None else len(data)
                raise ValueError(f"stage {self.stage} needs {m} microbatch {what}, got {got}")
        self.inputs, self.targets = inputs, targets
        if zero_grad:
            self.chunks.zero_grad(set_to_none=True)
        self._x: dict[tuple[int, int], torch.Tensor] = {}  # input of (mb, chunk)
        self._y: dict[tuple[int, int], torch.Tensor] = {}  # output (loss on the last virtual stage)
        self._dy: dict[tuple[int, int], torch.Tensor] = {}  # received gradient of the output
        self._pending: list[tuple[comm.P2PHandle, str]] = []  # sends in flight
        self._losses: list[torch.Tensor] = []  # each micro-batch's scaled loss, read by the host once, at the end
        self.times = {"forward": 0.0, "backward": 0.0, "comm": 0.0}
        start = time.perf_counter()
        self._negotiate = self._check_shapes(inputs)
        current: Instruction | str | None = None
        try:
            for item in batches(list(self.schedule.steps(self.stage))):
                current = " + ".join(str(i) for i in item) if isinstance(item, list) else item
                if isinstance(item, list):
                    t0 = time.perf_counter()
                    self._exchange(item)
                    self.times["comm"] += time.perf_counter() - t0
                else:
                    self.handlers[type(item)](item)
        except PipelineError:
            raise
        except comm.CommError as exc:
            raise self._error(current, exc) from exc
        except Exception as exc:
            raise PipelineError(self.stage, str(current), f"{type(exc).__name__}: {exc}") from exc
        self.times["total"] = time.perf_counter() - start
        return self._mean_loss() if self._holds(first=False) else None

    def _mean_loss(self) -> float:
        """The sum of the micro-batches' scaled losses, added in order in Python floats as a per-micro-batch
        read would (the same bits), from one read of the device: a `float()` per micro-batch made the
        host wait for each forward of the last stage on a GPU."""
        total = 0.0
        for value in (torch.stack([v.reshape(()) for v in self._losses]).tolist() if self._losses else []):
            total += value
        return total

    def _holds(self, first: bool) -> bool:
        return any(
            self.schedule.is_first(self.stage, c) if first else self.schedule.is_last(self.stage, c)
            for c in range(self.schedule.chunks)
        )

    def _error(self, ins: Instruction | str | None, exc: comm.CommError) -> PipelineError:
        lost = [self.pp.ranks.index(r) for r in exc.lost if r in self.pp.ranks]
        what = "the step's shape agreement" if ins is None else str(ins)
        return PipelineError(self.stage, what, str(exc), lost)

    def _check_shapes(self, inputs: Sequence[torch.Tensor] | None) -> bool:
        """Agree (one broadcast from the first stage) on whether this step's shapes are new."""
        key = torch.tensor([shape_key(inputs) if self.stage == 0 else 0], dtype=torch.int64)
        try:
            comm.broadcast(key, src=0, group=self.pp)
        except comm.CommError as exc:
            raise self._error(None, exc) from exc
        changed = int(key) != self._shape_key
        self._shape_key = int(key)
        return changed

    # ---- compute handlers
    def _load(self, ins: LoadMicrobatch) -> None:
        if self.schedule.is_first(self.stage, ins.chunk):
            self._x[(ins.mb, ins.chunk)] = self.inputs[ins.mb]  # type: ignore[index]

    def _forward(self, ins: Forward) -> None:
        t0 = time.perf_counter()
        key = (ins.mb, ins.chunk)
        chunk = self.chunks[ins.chunk]
        x = self._x[key]
        last = self.schedule.is_last(self.stage, ins.chunk)
        run = chunk
        if last and self.with_targets is not None:
            targets, around = self.targets[ins.mb], self.with_targets  # type: ignore[index]

            def run(x: torch.Tensor, chunk: nn.Module = chunk) -> torch.Tensor:
                with around(targets):
                    return chunk(x)
        # Non-reentrant checkpointing keeps no intermediates and recomputes them in backward.
        y = torch_checkpoint(run, x, use_reentrant=False) if self.checkpoint else run(x)
        if last:
            # Scaled so gradients accumulated over the microbatches are those of the mean loss.
            y = self.loss_fn(y, self.targets[ins.mb]) / self.schedule.microbatches  # type: ignore[index]
            self._losses.append(y.detach())
        self._y[key] = y
        self.times["forward"] += time.perf_counter() - t0

    def _backward(self, ins: Backward) -> None:
        t0 = time.perf_counter()
        key = (ins.mb, ins.chunk)
        y = self._y.pop(key)
        if self.schedule.is_last(self.stage, ins.chunk):
            y.backward()
        else:
            y.backward(self._dy.pop(key))
        if self.schedule.is_first(self.stage, ins.chunk):
            self._x.pop(key)
        self.times["backward"] += time.perf_counter() - t0

    def _reduce_tied(self, ins: ReduceTiedGrads) -> None:
        for key, group in sorted(self.tied_groups.items()):
            p = self.tied_params[key]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, "sum", group=group)

    def _optimizer_step(self, ins: OptimizerStep) -> None:
        # Sends still in flight must land before the step ends (their peers wait on them).
        for handle, what in self._pending:
            try:
                handle.wait()
            except comm.CommError as exc:
                raise self._error(what, exc) from exc
        self._pending = []
        if self.optimizer is not None:
            self.optimizer.step()

    # ---- communication: one batch of consecutive send/recv instructions
    def _exchange(self, batch: list[CommInstruction]) -> None:
        faults.crash_point("pipeline.transfer", stage=self.stage)
        sched = self.schedule
        if self._negotiate:
            self._exchange_headers(batch)
        ops: list[comm.P2POp] = []
        received: list[tuple[tuple[int, int], torch.Tensor]] = []
        for ins in batch:
            key = (ins.mb, ins.chunk)
            if isinstance(ins, SendActivation):
                ops.append(
                    comm.P2POp(
                        "send", self._y[key].detach().contiguous(), sched.next_stage(self.stage)
                    )
                )
            elif isinstance(ins, SendGrad):
                x = self._x.pop(key)
                g = x.grad if x.grad is not None else torch.zeros_like(x)
                ops.append(comm.P2POp("send", g.contiguous(), sched.prev_stage(self.stage)))
            elif isinstance(ins, RecvActivation):
                shape, dtype = self._act_meta[key]
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                ops.append(comm.P2POp("recv", buf, sched.prev_stage(self.stage)))
                received.append((key, buf))
            elif isinstance(ins, RecvGrad):
                y = self._y[key]
                buf = torch.empty(y.shape, dtype=y.dtype, device=y.device)
                ops.append(comm.P2POp("recv", buf, sched.next_stage(self.stage)))
                self._dy[key] = buf
        self._post(ops, " + ".join(str(i) for i in batch))
        for key, buf in received:
            # A received activation is a leaf of this stage's graph; SendGrad sends its .grad.
            self._x[key] = buf.requires_grad_(buf.is_floating_point())

    def _post(self, ops: list[comm.P2POp], what: str, group: comm.Group | None = None) -> None:
        self._retire_sends()
        handle = comm.exchange(ops, group=group or self.pp)
        if any(op.kind == "recv" for op in ops):
            handle.wait()
        else:
            self._pending.append((handle, what))

    def _retire_sends(self) -> None:
        """Wait for the sends that completed: a send's handle holds its tensor (a stage's output, an input's
        gradient) until waited, so sends kept to the step's end would hold every micro-batch's boundary
        tensors where 1F1B needs a stage's in-flight ones only (on a GPU, device memory)."""
        if not self._pending:
            return
        still = []
        for handle, what in self._pending:
            if handle.is_completed():
                try:
                    handle.wait()
                except comm.CommError as exc:
                    raise self._error(what, exc) from exc
            else:
                still.append((handle, what))
        self._pending = still

    def _exchange_headers(self, batch: list[CommInstruction]) -> None:
        ops, received = [], []
        for ins in batch:
            key = (ins.mb, ins.chunk)
            if isinstance(ins, SendActivation):
                ops.append(
                    comm.P2POp(
                        "send", encode_header(self._y[key]), self.schedule.next_stage(self.stage)
                    )
                )
            elif isinstance(ins, RecvActivation):
                h = torch.zeros(HEADER_LEN, dtype=torch.int64)
                ops.append(comm.P2POp("recv", h, self.schedule.prev_stage(self.stage)))
                received.append((key, h))
        if ops:
            self._post(ops, "headers", self.header_group)
        for key, h in received:
            self._act_meta[key] = decode_header(h)
