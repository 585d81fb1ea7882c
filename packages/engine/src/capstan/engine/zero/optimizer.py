"""Data parallelism with ZeRO stages 0-2 over one flat fp32 parameter buffer (or a bf16 one that is its
own master, below).

Every parameter becomes a view into one flat buffer, and its gradient a view
into a flat gradient buffer of the same layout (Rajbhandari et al. 2020,
"ZeRO", section 5). The buffer is ordered in four segments, so the update and
the norm can treat whole ranges alike:

    [ tp-sliced, decayed | tp-sliced, no decay | replicated, decayed | replicated, no decay ]

and padded to a multiple of the dp size so every rank's shard has the same length.

* stage 0: gradients are averaged over dp with all-reduces; every rank updates
  everything.
* stage 1: gradients are averaged with all-reduces; rank r updates only its
  shard (``shard_bounds``) and keeps Adam moments for it alone (1/dp of the
  optimizer state), then the shards are all-gathered into the parameters
  (with ``gather_bytes > 0`` in buckets that the next forward waits for:
  gather.py).
* stage 2: after each micro-batch the gradient is reduced over dp into this
  rank's shard accumulator. With overlapped all-reduce buckets (the default)
  there is no flat gradient at all: each parameter's gradient is copied into
  its bucket as backward completes it and dropped, and a rank holds its 1/dp
  shard plus at most a few buckets (buckets.py; `grad_bytes_peak`). Under
  a pipeline (whose schedule holds every gradient until its last backward)
  they all-reduce the flat gradient in place, and the shard's range of it
  is the shard gradient. With reduce-scatter buckets or none
  (``bucket_bytes = 0``) the whole flat gradient exists during backward and
  is cleared after each reduction.

With ``bucket_bytes > 0`` (``parallel.bucket_mb``, the engine's default) the
communication overlaps backward: gradient hooks start each bucket's
all-reduce (stages 0 and 1, on the last micro-batch of an accumulation only,
like DDP's ``no_sync``; stage 2 on every micro-batch, keeping the shard's part)
or, for stage 2 with ``zero2_collective = "reduce_scatter"``, its
reduce-scatter, as soon as its gradients are complete; buckets.py has
the bucket layouts.
`after_backward` and `reduce_gradients` wait for them. Under pipeline
parallelism one schedule runs every micro-batch's backward before the single
`after_backward` of the step, so each parameter's hook counts
``pipeline_microbatches`` gradients before its bucket may start (during the
schedule's last backwards, as Megatron-LM's overlapped gradient reduction),
and tied weights, summed over their stages only at the schedule's end, sit
first in the buffer and go with `finish()`. With ``bucket_bytes = 0``
everything runs after backward instead: stage 0 through
`comm.all_reduce_coalesced`, stage 1 as one all-reduce, stage 2 as one
reduce-scatter per micro-batch (per step under pipeline parallelism).

The gradient norm for clipping is global over dp, tp and pp: squares of a shard
are summed over dp; tp-sliced parameters are summed over tp, and replicated
ones (identical on every tp rank, see docs/tensorpar.md) counted once; with
pipeline parallelism each stage holds its own parameters (the reference GPT's
head is untied), so the stages' sums add up over the pp group; a weight tied
across stages (a user pipeline's LayerSpec `tied`) counts on the lowest stage
that holds it only.

``compression`` (``parallel.compression``, compression.py): "onebit" runs
1-bit Adam at stage 0 (after the freeze the gradients stay local, so the norm
for clipping is the root mean square of the ranks' own gradient norms, an upper
bound of the averaged gradient's); "int8" reduces gradients with an int8
reduce-scatter after backward (no buckets) and gathers parameters with an int8
all-gather at stages 1/2 (in buckets overlapped with the next forward where
the exact gather would be: gather.py), keeping the master shard exact in
`master`.

One replica on an accelerator in fp32 (``direct``): there is nothing to reduce, so the gradients stay
autograd's own tensors, as in plain PyTorch, and step in fused multi-tensor calls (direct.py).

``master_dtype = torch.bfloat16`` (``precision.master_weights = "bf16"``): the flat buffer holds bf16
parameters that are their own master, as the chunks' bf16 master does (docs/chunkmem.md): the model
computes with them, their gradients are bf16 in a flat gradient of the same dtype, and Adam steps them in
fp32 and stores them with stochastic rounding drawn from (step, flat position), so an element gets the
bits it gets in the chunks. The packed ZeRO-2 buckets and the reduce-scatter buckets reduce in fp32 (the
shard accumulator is bf16); in-place all-reduces (stages 0 and 1) reduce the bf16 gradient itself, as
the chunks' own reductions of a bf16 master's gradients do. int8 compression keeps an fp32 master shard
and is refused with it (the config's check).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from capstan import comm
from capstan.comm.job.accelerator import is_accelerator
from capstan.native import device_ops, kernels

from ..config.schema import TrainConfig
from .buckets import OverlappedBuckets, packed_bucket_elems, plan_all_reduce, plan_reduce_scatter
from .compression import OneBitAdam, int8_all_gather, int8_reduce_scatter
from .direct import AutogradGrads
from .gather import ParamPrefetch
from .moments import ShardMoments

__all__ = ["ZeroOptimizer", "Segment", "decays", "group_order"]


def decays(param: torch.Tensor) -> bool:
    """Weight decay on matrices only; biases and norm parameters are left alone (GPT-2/3 practice)."""
    return param.dim() >= 2


# Set on a tied weight's copy on every pipeline stage but the lowest that holds it (pipe.py): the
# copies have equal gradients (the executor sums them over the tied group), so the global gradient
# norm counts one of them.
STAGE_COPY_ATTR = "capstan_stage_copy"


def is_stage_copy(p: torch.Tensor) -> bool:
    return getattr(p, STAGE_COPY_ATTR, False)


def group_order(p: torch.Tensor) -> tuple[bool, bool, bool]:
    """The class a parameter is stepped and counted with, as a sort key: tp-sliced before replicated,
    decayed before not, a tied weight's stage copy last. One set of Adam hyper-parameters and one weight
    in the global gradient norm per class: the flat ZeRO buffer lays its segments out in this order and
    the chunked engine makes one chunk list per class in it (engine.py), so both group alike."""
    return getattr(p, "tp_dim", None) is None, not decays(p), is_stage_copy(p)


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    decay: bool
    sliced: bool
    counted: bool = True  # False: another pipeline stage's copy of a tied weight counts in the norm


class ZeroOptimizer:
    """AdamW over a flat buffer with ZeRO stage 0, 1 or 2 over `groups.replicas` (the dp group, or dp x cp
    with context parallelism: every rank holding the same parameters; see the module docstring)."""

    def __init__(self, model: nn.Module, groups: comm.Groups, stage: int, train: TrainConfig,
                 bucket_bytes: int = 0, zero2_collective: str = "all_reduce", gather_bytes: int = 0,
                 pipeline_microbatches: int = 0, late_params: Sequence[torch.Tensor] = (),
                 compression: str = "none", freeze_steps: int = 0,
                 moment_dtype: torch.dtype = torch.float32, master_dtype: torch.dtype = torch.float32) -> None:
        """pipeline_microbatches > 0: gradients come from a pipeline schedule, one `after_backward` per
        step after all its micro-batches; the buckets then count that many accumulations per parameter
        and start while the schedule's last backwards run. late_params: sent only after the schedule
        (tied weights, summed over their stages at its end). compression, freeze_steps: see the module
        docstring and compression.py."""
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroOptimizer handles ZeRO stages 0-2, got {stage}")
        if (compression, stage == 0) in (("onebit", False), ("int8", True)) or compression not in (
                "none", "onebit", "int8"):
            raise ValueError(f"compression {compression!r} does not apply to ZeRO stage {stage}")
        if master_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"master_dtype must be torch.float32 or torch.bfloat16, got {master_dtype}")
        if master_dtype != torch.float32 and compression != "none":
            raise ValueError(f"compression {compression!r} keeps an fp32 master: it cannot take a bf16 one")
        self.compression = compression
        self.groups, self.stage, self.train = groups, stage, train
        params = [p for p in model.parameters() if p.requires_grad]
        self._names = {id(p): name for name, p in model.named_parameters()}  # for overflow diagnostics
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("ZeroOptimizer takes an fp32 model (a bf16 master is cast from it): build it in fp32")
        # Replicated across tp = tp_dim is None (tensorpar marks); plain modules count as replicated.
        # Late parameters first: buckets start from the buffer's end, in order, so theirs go last.
        late_ids = {id(t) for t in late_params}
        key = [(id(p) not in late_ids, *group_order(p)) for p in params]
        order = sorted(range(len(params)), key=lambda i: key[i])
        self.params = [params[i] for i in order]
        numel = sum(p.numel() for p in self.params)
        dp = groups.replicas.size
        self.numel = numel
        self.padded = -(-numel // dp) * dp
        dev = self.device = params[0].device if params else torch.device("cpu")  # where the model is (a GPU)
        overlap = bucket_bytes > 0 and dp > 1 and compression != "int8"  # int8 reduces after backward
        # ZeRO 2 over all-reduce buckets: packed (no flat gradient; each rank holds its shard and a few
        # buckets), except under a pipeline, whose schedule accumulates every micro-batch's gradient in the
        # parameters anyway: there the buckets all-reduce the flat gradient in place and the shard's range
        # of it is the shard gradient (one schedule per step: nothing to accumulate across).
        all_reduce = overlap and stage == 2 and zero2_collective == "all_reduce" and compression == "none"
        self.lean = all_reduce and not pipeline_microbatches
        in_place = all_reduce and bool(pipeline_microbatches)
        self.master_dtype = master_dtype  # the parameters' and their gradients' dtype (bf16: the master itself)
        self.flat_param = torch.zeros(self.padded, device=dev, dtype=master_dtype)
        # One replica on an accelerator, fp32 throughout, nothing to reduce: the gradients stay autograd's own
        # tensors (direct.py), not views of a flat gradient.
        self.direct = (dp == 1 and stage < 2 and not pipeline_microbatches and compression == "none"
                       and is_accelerator(dev) and master_dtype == moment_dtype == torch.float32
                       and device_ops.fused_available(dev))
        self.flat_grad = (None if self.lean or self.direct else
                          torch.zeros(self.padded, device=dev, dtype=master_dtype))
        self.segments: list[Segment] = []
        pos = 0
        for i in order:
            p = params[i]
            n = p.numel()
            self.flat_param[pos : pos + n].copy_(p.detach().reshape(-1))
            p.data = self.flat_param[pos : pos + n].view_as(p)  # (a bf16 master: the parameter becomes bf16)
            seg = Segment(pos, pos + n, decays(p), not key[i][1], not key[i][3])
            last = self.segments[-1] if self.segments else None
            if last and (last.decay, last.sliced, last.counted) == (seg.decay, seg.sliced, seg.counted) \
                    and last.end == pos:
                self.segments[-1] = Segment(last.start, seg.end, seg.decay, seg.sliced, seg.counted)
            else:
                self.segments.append(seg)
            pos += n
        self._grad_views = None if self.flat_grad is None else [
            self.flat_grad[s : s + p.numel()].view_as(p) for p, s in zip(self.params, _offsets(self.params))]
        for p, g in zip(self.params, self._grad_views or [None] * len(self.params)):
            p.grad = g
        # Replicas must start equal: a user module may have been initialized differently per rank.
        comm.broadcast(self.flat_param, src=0, group=groups.replicas)
        self.lo, self.hi = (0, self.padded) if stage == 0 else comm.shard_bounds(self.padded, dp, groups.replicas.rank)
        # bf16 moments (precision.optimizer_states) round stochastically from (step, flat position): the
        # same bits for an element whatever the stage and dp, and as in the chunks (chunkmem's
        # optim/moments.py numbers elements in this buffer's order). 8-bit ones: moments.py.
        self.moments = ShardMoments([p.numel() for p in self.params], _offsets(self.params), self.lo, self.hi,
                                    [(a, b) for _, a, b in self._pieces()], dev, moment_dtype)
        m = self.moments  # (the same tensors under the names the checkpoint views and 1-bit Adam use)
        self.exp_avg, self.exp_avg_sq, self.scale_m, self.scale_v, self.q8 = (
            m.exp_avg, m.exp_avg_sq, m.scale_m, m.scale_v, m.q8)
        self.autograd = self._autograd_grads() if self.direct else None
        self.step_count = 0
        self.micro = 0  # after_backward calls since the last reduce_gradients / zero_grad
        # Backward passes per optimizer step: the accumulation's micro-batches, or one pipeline schedule.
        self.passes = 1 if pipeline_microbatches else train.grad_accum_steps
        # Compressed collectives run per region: at tp > 1 the tp-sliced and the replicated parameters
        # apart (a scale over replicated values alone is the same on every tp rank), else all in one.
        self.regions = _regions(self.segments, groups.tp.size)
        self.onebit = OneBitAdam(self.regions, groups.replicas, freeze_steps, dev) if compression == "onebit" else None
        self.shard_grad = (torch.zeros(self.hi - self.lo, device=dev, dtype=master_dtype) if stage == 2 and not in_place
                           else None)
        self.overlap: OverlappedBuckets | None = None
        if overlap:
            offsets, sizes = _offsets(self.params), [p.numel() for p in self.params]
            elems = max(1, bucket_bytes // 4)
            # Buckets fill in the order backward completes gradients: the module's parameters backwards,
            # the pipeline's tied weights (sent after the schedule) last (buckets.py).
            late = [k for k in range(len(order)) if id(self.params[k]) in late_ids]
            ready = sorted((k for k in range(len(order)) if id(self.params[k]) not in late_ids),
                           key=lambda k: -order[k]) + late
            plan = (plan_reduce_scatter(offsets, sizes, self.padded, dp, elems)
                    if stage == 2 and zero2_collective == "reduce_scatter" else
                    plan_all_reduce(offsets, sizes, packed_bucket_elems(elems, numel) if self.lean else elems, ready))
            self.overlap = OverlappedBuckets(self.params, self._grad_views, self.flat_grad, plan, groups.replicas,
                                             self.shard_grad, (self.lo, self.hi), max(1, pipeline_microbatches),
                                             frozenset(late), offsets)
            self._arm()
        # int8: this rank's exact fp32 master shard; flat_param holds what the quantized gather delivered.
        self.master = self.flat_param[self.lo : self.hi].clone() if compression == "int8" else None
        self.cuts = [b for _, b in self.regions]  # int8 blocks break at the regions' ends
        # int8: an inf/NaN seen before quantizing (which would hide it); on an accelerator a flag left there
        self._local_nonfinite: bool | torch.Tensor = False
        self.prefetch: ParamPrefetch | None = None
        if gather_bytes > 0 and dp > 1 and stage > 0:  # (int8: its buckets quantized from the master shard)
            self.prefetch = ParamPrefetch(model, self.params, _offsets(self.params), self.flat_param, groups.replicas,
                                          max(1, gather_bytes // 4), source=self.master, cuts=self.cuts)

    def _arm(self) -> None:
        """Communicate in the next backward? Stage 2 always; stages 0/1 on the accumulation's last
        micro-batch; never once 1-bit Adam compresses (the gradients then stay on their rank)."""
        if self.overlap is not None:
            self.overlap.armed = (self.stage == 2 or self.micro == self.passes - 1) and not self.compressing

    @property
    def compressing(self) -> bool:
        """1-bit Adam past its freeze: the next step averages the momentum in 1 bit, not the gradients."""
        return self.onebit is not None and self.onebit.compressing(self.step_count)

    # ---- gradients ------------------------------------------------------------------------------
    def _repoint_grads(self) -> None:
        """Autograd accumulates into the existing `.grad` in place; if anything replaced it, fold it back."""
        if self._grad_views is None:  # packed ZeRO 2 buckets took every gradient
            return
        for p, g in zip(self.params, self._grad_views):
            if p.grad is not g:
                if p.grad is not None:
                    g.add_(p.grad)
                p.grad = g

    def after_backward(self) -> None:
        """Called after every micro-batch's backward."""
        if self.autograd is not None:
            self.autograd.forget()
        self._repoint_grads()
        self.micro += 1
        if self.overlap is not None:
            ran = self.overlap.finish()
            if self.flat_grad is not None and self.shard_grad is not None and ran:  # stage 2, kept in the shard
                self.flat_grad.zero_()
            self._arm()
            if ran or self.stage < 2:
                return
        if self.stage == 2 and self.compression == "int8":
            self._int8_reduce(self.shard_grad, accumulate=True)  # type: ignore[arg-type]
            self.flat_grad.zero_()
        elif self.stage == 2:
            part = torch.empty(self.hi - self.lo, device=self.device, dtype=self.flat_grad.dtype)
            # flat_grad is cleared next
            comm.reduce_scatter(part, self.flat_grad, op="avg", group=self.groups.replicas, overwrite_input=True)
            self.shard_grad.add_(part)  # type: ignore[union-attr]
            self.flat_grad.zero_()

    def _int8_reduce(self, out: torch.Tensor, accumulate: bool) -> None:
        """This rank's shard of the dp average of the flat gradient, reduced in int8, into (or onto) `out`;
        an inf/NaN is noted first (quantizing would turn it into a finite value)."""
        if self.flat_grad.device.type == "cpu":
            self._local_nonfinite = self._local_nonfinite or kernels.has_nonfinite(self.flat_grad)
        else:  # kept on the device, read once in has_overflow: not a host wait per micro-batch
            flag = device_ops.nonfinite_tensor(self.flat_grad)
            self._local_nonfinite = flag if self._local_nonfinite is False else self._local_nonfinite | flag
        part = torch.empty(self.hi - self.lo, device=self.device)
        int8_reduce_scatter(self.flat_grad, part, self.groups.replicas, self.cuts)
        if accumulate:
            out.add_(part)
        else:
            out.copy_(part)

    def reduce_gradients(self) -> None:
        """Average gradients over dp at the end of gradient accumulation (1-bit Adam past its freeze:
        nothing; its step averages the momentum)."""
        micro, self.micro = self.micro, 0
        if self.direct:  # one replica
            return
        if self.compressing:
            self._arm()
            return
        if self.compression == "int8":
            if self.stage == 1:
                self._int8_reduce(self.flat_grad[self.lo : self.hi], accumulate=False)
            return
        if self.overlap is not None:
            self._arm()
            if self.stage == 2 or micro == self.passes:
                return  # the buckets already ran during the last backward (after_backward waited)
        if self.stage == 0:
            comm.all_reduce_coalesced(self._grad_views, op="avg", group=self.groups.replicas)
        elif self.stage == 1:
            comm.all_reduce(self.flat_grad, op="avg", group=self.groups.replicas)

    def _autograd_grads(self) -> AutogradGrads:
        """direct: which parameters count in the global norm on this rank, and each one's weight decay."""
        offsets, counted = _offsets(self.params), []
        for start in offsets:
            seg = next((s for s in self.segments if s.start <= start < s.end), None)  # (None: an empty tensor)
            counted.append(seg is not None and seg.counted and (seg.sliced or self.groups.tp.rank == 0))
        wd = [self.train.weight_decay if decays(p) else 0.0 for p in self.params]
        return AutogradGrads(self.params, offsets, counted, wd, self.exp_avg, self.exp_avg_sq)

    def _shard_grad(self) -> torch.Tensor:
        return self.shard_grad if self.shard_grad is not None else self.flat_grad[self.lo : self.hi]

    def _pieces(self) -> list[tuple[Segment, int, int]]:
        """(segment, start, end) of every segment's intersection with this rank's shard."""
        out = []
        for seg in self.segments:
            a, b = max(seg.start, self.lo), min(seg.end, self.hi)
            if a < b:
                out.append((seg, a, b))
        return out

    def grad_norm(self) -> float:
        """Global L2 norm of the (loss-scaled) gradients over dp, tp and pp (stages' parameters are disjoint)."""
        if self.autograd is not None:  # one multi-tensor norm over autograd's gradients, one read
            total = self.autograd.sumsq(self.device).reshape(1)
            comm.all_reduce(total, group=self.groups.tp)
            comm.all_reduce(total, group=self.groups.pp)
            return math.sqrt(float(total.item()))
        g = self._shard_grad()
        # Replicated parameters count once per tp group, tied weights once over the stages.
        counted = [(a, b) for seg, a, b in self._pieces() if seg.counted and (seg.sliced or self.groups.tp.rank == 0)]
        on_device = is_accelerator(g.device)
        if on_device:
            # Summed there, one read by the host per step; adjacent counted pieces as one span (at tp 1 the
            # whole shard): each reduction is a handful of kernel launches, and a GPU step's host launches them.
            local = torch.zeros((), dtype=torch.float64, device=g.device)
            for a, b in _spans(counted):
                local = local + device_ops.sumsq_tensor(g[a - self.lo : b - self.lo])
            total = local.reshape(1)
        else:  # per piece, as the chunks sum theirs (the same bits where the layouts' math is the same)
            total = torch.tensor([sum(kernels.sumsq(g[a - self.lo : b - self.lo]) for a, b in counted)],
                                 dtype=torch.float64)
        if self.stage > 0:
            comm.all_reduce(total, group=self.groups.replicas)
        elif self.compressing:  # each rank's own gradient: the root mean square of their norms
            comm.all_reduce(total, op="avg", group=self.groups.replicas)
        comm.all_reduce(total, group=self.groups.tp)
        comm.all_reduce(total, group=self.groups.pp)  # pipeline stages hold disjoint parameters
        return math.sqrt(float(total.item()))

    def has_overflow(self) -> bool:
        """True if any rank's gradients hold inf/NaN (all ranks then skip the step together)."""
        if self.autograd is not None:
            bad = self.autograd.nonfinite()
        else:
            bad = bool(self._local_nonfinite) or kernels.has_nonfinite(self._shard_grad())
        flag = torch.tensor([1.0 if bad else 0.0])
        comm.all_reduce(flag, op="max", group=self.groups.replicas)
        comm.all_reduce(flag, op="max", group=self.groups.tp)
        comm.all_reduce(flag, op="max", group=self.groups.pp)
        return bool(flag.item())

    def nonfinite_params(self) -> list[str]:
        """Names of the parameters whose gradient holds inf/NaN in this rank's shard (in buffer order):
        which layers overflowed, for the message of a skipped fp16 step. Runs only after an overflow."""
        if self.autograd is not None:
            return [self._names.get(id(p), "?") for p in self.autograd.nonfinite_params()]
        g, names = self._shard_grad(), []
        for p, start in zip(self.params, _offsets(self.params)):
            a, b = max(start, self.lo), min(start + p.numel(), self.hi)
            if a < b and kernels.has_nonfinite(g[a - self.lo : b - self.lo]):
                names.append(self._names.get(id(p), "?"))
        return names

    def zero_grad(self) -> None:
        self.micro = 0
        self._local_nonfinite = False
        if self.autograd is not None:
            self.autograd.forget()
        self._arm()
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        else:  # (packed buckets: gradients of an unarmed pass would sit in the parameters)
            for p in self.params:
                p.grad = None
        if self.shard_grad is not None:
            self.shard_grad.zero_()

    # ---- update ---------------------------------------------------------------------------------
    def step(self, lr: float, grad_scale: float) -> None:
        """AdamW on this rank's shard (grad_scale folds clipping and 1/loss_scale), then all-gather."""
        self.wait_params()
        t = self.train
        compressing = self.compressing  # (decided by the steps taken before this one)
        self.step_count += 1
        if self.onebit is not None and compressing:
            pieces = [(a, b, t.weight_decay if seg.decay else 0.0) for seg, a, b in self._pieces()]
            self.onebit.step(self.flat_param, self.flat_grad, self.exp_avg, self.exp_avg_sq, pieces=pieces,
                             step=self.step_count, lr=lr, beta1=t.beta1, beta2=t.beta2, eps=t.eps,
                             grad_scale=grad_scale)
            return
        if self.autograd is not None:
            self.autograd.step(step=self.step_count, lr=lr, beta1=t.beta1, beta2=t.beta2, eps=t.eps,
                               grad_scale=grad_scale)
            return
        # int8: Adam steps the exact master shard, then every rank gathers the quantized shards.
        param = self.master if self.master is not None else self.flat_param[self.lo : self.hi]
        pieces = [(a, b, t.weight_decay if seg.decay else 0.0) for seg, a, b in self._pieces()]
        self.moments.step(param, self._shard_grad(), pieces, step=self.step_count, lr=lr, beta1=t.beta1,
                          beta2=t.beta2, eps=t.eps, grad_scale=grad_scale)
        if self.prefetch is not None:
            self.prefetch.start()  # waited for by the next forward's pre-hooks (gather.py; int8 too)
        elif self.master is not None:
            int8_all_gather(self.flat_param, self.master, self.groups.replicas, self.cuts)
        elif self.stage > 0:
            shard = self.flat_param[self.lo : self.hi].clone()  # the collective must not alias its output
            comm.all_gather(self.flat_param, shard, group=self.groups.replicas)

    def exact_param(self, a: int, b: int) -> torch.Tensor:
        """Flat elements [a, b) of the parameters at full precision (int8: from the master shard, which
        must hold them; else the buffer)."""
        if self.master is not None and self.lo <= a <= b <= self.hi:
            return self.master[a - self.lo : b - self.lo]
        return self.flat_param[a:b]

    def after_load(self) -> None:
        """A checkpoint was written into flat_param: int8 takes its master shard from it and, past the
        first step, computes with the quantized gather of it, as the run that saved it did."""
        if self.master is not None:
            self.master.copy_(self.flat_param[self.lo : self.hi])
            if self.step_count > 0 and self.prefetch is not None:  # the same buckets as the saving run's
                self.prefetch.start()
            elif self.step_count > 0:
                int8_all_gather(self.flat_param, self.master, self.groups.replicas, self.cuts)

    def q8_moment(self, field: str, start: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """8-bit moments: the codes and block scales of `field` of the parameter at flat offset `start`
        (its part in this shard), or None where this shard holds none of it."""
        return self.moments.q8_moment(field, start)

    def wait_params(self) -> None:
        """Finish the overlapped parameter all-gather: every rank's parameters are current afterwards."""
        if self.prefetch is not None:
            self.prefetch.wait_all()

    def grad_bytes_peak(self) -> int:
        """Most bytes of gradient this rank held at once: the flat gradient and the shard accumulator, or
        (packed ZeRO 2 buckets) the shard and the most bucket buffers alive together (autograd's own
        transient gradients, before a hook copies them, are not counted)."""
        held = sum(t.numel() * t.element_size() for t in (self.flat_grad, self.shard_grad) if t is not None)
        if self.autograd is not None:  # autograd's gradients, from backward to zero_grad
            held += self.autograd.nbytes
        return held + (self.overlap.held_peak if self.overlap is not None else 0)

    def state_bytes(self) -> int:
        """Bytes of model and optimizer state this rank holds (params, grads, shard grads, moments)."""
        tensors = [t for t in (self.flat_param, self.flat_grad) if t is not None] + self.moments.tensors()
        if self.shard_grad is not None:
            tensors.append(self.shard_grad)
        if self.master is not None:
            tensors.append(self.master)
        if self.onebit is not None:
            tensors += list(self.onebit.state_tensors().values())
        direct = self.autograd.nbytes if self.autograd is not None else 0  # autograd's gradients
        return direct + sum(x.numel() * x.element_size() for x in tensors)


def _regions(segments: list[Segment], tp: int) -> list[tuple[int, int]]:
    """The flat ranges compressed on their own: runs of segments alike in being tp-sliced (one run at
    tp = 1)."""
    out: list[tuple[int, int, bool]] = []
    for seg in segments:
        if out and out[-1][1] == seg.start and (tp == 1 or out[-1][2] == seg.sliced):
            out[-1] = (out[-1][0], seg.end, out[-1][2])
        else:
            out.append((seg.start, seg.end, seg.sliced))
    return [(a, b) for a, b, _ in out]


def _spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent [a, b) ranges joined."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _offsets(params: list[torch.Tensor]) -> list[int]:
    out, pos = [], 0
    for p in params:
        out.append(pos)
        pos += p.numel()
    return out
