"""`ChunkAdam`: AdamW over chunks, one sibling group (param, grad, master, moments) at a time.

Sibling chunks share offsets, so the update runs on whole flat chunks: the
element-wise arithmetic of `torch.optim.AdamW` (capstan.native's SIMD
kernels follow ATen op by op; docs/native.md) over a few large buffers
instead of many small tensors. Chunks on disk stream through the cpu budget
in order; with the warm-up trace the manager reads the next ones ahead.

Mixed precision: the fp32 MASTER chunk is updated and the new value is cast
into the 16-bit PARAM chunk in the same pass (the fused native kernel). In
slot-reuse mode the gradient is read from the PARAM slot and overwritten by
the new parameter element by element (safe: each element is read before it
is written). With a loss scale, gradients are unscaled on the fly and a
first pass checks them all for inf/NaN; on overflow nothing is updated and
the 16-bit parameters are restored from their masters.

Adam's moments may be bf16 chunks (`ChunkedModel(moment_dtype=torch.bfloat16)`): the kernel updates
them in fp32 and stores them with stochastic rounding (moments.py).

Gradients are consumed by the step (their chunks read as zeros again, which
is `zero_grad`).

`ChunkAdam(model, overlap=True)` steps each chunk group while backward is
still running, as soon as its gradients are complete, and validates at the
step (overlap.py): the result is the same as without overlap, bit for bit.
Call `arm(...)` before the backward that completes the step's gradients.

Deferred update (overlap.py, "measure only" past RAM on disk): a step whose
norm was measured in backward leaves each chunk group's update *pending*,
with the step's arguments (learning rate, step count, clip coefficient), and
the next forward runs it just before the group's parameters are first used
(`ChunkedModel.pending_update`), so the parameters read for the update are
the ones forward reads anyway: one pass over the states per step fewer, and
all of them under forward's compute. `flush_pending` runs what is left, for
anything that reads the states between steps (checkpoints, evaluation,
`state_tensors`); `arm` and `step` flush leftovers (groups no forward used)
before their gradients could be read. The update is the same call on the
same bytes as after backward, so the trajectory is the same, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass

from capstan.native import kernels

from ..memory.tiers import BudgetError
from ..model.chunked import ChunkedModel
from ..model.states import ChunkKind
from .moments import step_chunk
from .overlap import Speculation, can_overlap

__all__ = ["ChunkAdam", "AdamGroup"]


@dataclass
class AdamGroup:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    step: int = 0


class ChunkAdam:
    """AdamW (decoupled weight decay) for a `ChunkedModel`; one `AdamGroup` per parameter group."""

    def __init__(self, model: ChunkedModel, groups: list[AdamGroup] | None = None, overlap: bool = False,
                 copy_room: Callable[[], int] | None = None, disk_room: Callable[[], int] | None = None,
                 **defaults: object) -> None:
        n = model.n_param_groups  # (a group may have a side list too: model.list_group)
        self.model = model
        self.groups = groups or [AdamGroup(**defaults) for _ in range(n)]  # type: ignore[arg-type]
        if len(self.groups) != n:
            raise ValueError(f"{len(self.groups)} optimizer groups for {n} parameter groups")
        for g in self.groups:
            if g.lr < 0 or g.eps < 0 or not all(0.0 <= b < 1.0 for b in g.betas) or g.weight_decay < 0:
                raise ValueError(f"invalid Adam hyper-parameters: {g}")
        # Names of the parameters whose gradient held inf/NaN on this rank at the last skipped step.
        self.overflowed: list[str] = []
        # (group, index) -> the update's kernel arguments, left for the next forward (module docstring)
        self.pending: dict[tuple[int, int], dict] = {}
        self.deferred_run = 0  # pending updates run (by forward's hooks or a flush), for tests and the log
        self.speculation: Speculation | None = None
        if overlap:
            why = can_overlap(model)
            if why is not None:
                raise ValueError(f"ChunkAdam(overlap=True) cannot overlap this model's step with backward: {why}")
            if not model.report_grads:
                raise ValueError("ChunkAdam(overlap=True) needs ChunkedModel(..., report_grads=True)")
            # copy_room: the bytes RAM can still take, read each step; a step whose rollback copies would
            # take more than half of it measures instead of guessing; disk_room: the same for the disk's
            # second slots past RAM (default: the disk tier's free bytes) (overlap.py)
            self.speculation = Speculation(self, copy_room=copy_room, disk_room=disk_room)

    def arm(self, grad_clip: float | None = None, loss_scale: float = 1.0, check_overflow: bool = False,
            arrivals: int = 1) -> None:
        """overlap=True: call before the backward that completes this step's gradients (the last
        micro-batch's; `arrivals` gradients per parameter when one call runs several, as a pipeline
        schedule does), with the learning rates already set and the arguments `step` will get."""
        if self.speculation is None:
            raise RuntimeError("arm() needs ChunkAdam(..., overlap=True)")
        self.flush_pending()  # groups no forward used: before this step's gradients arrive
        # The last step clipped or overflowed: this one steps after backward, but the chunks' norm terms are
        # taken during backward as their gradients complete (overlap.py, "measure only").
        update = not self.speculation.expect_wrong(grad_clip, check_overflow)
        self.speculation.arm(grad_clip, loss_scale, check_overflow, arrivals, update=update)

    @property
    def armed(self) -> bool:
        return self.speculation is not None and self.speculation.armed

    def _grad_kind(self) -> ChunkKind:
        return ChunkKind.GRAD if self.model.grad_chunks else ChunkKind.PARAM

    def _each_grad(self, weighted: bool = False, lazy: dict | set = frozenset()):  # noqa: ANN202
        """(group, index, chunk, used) of every owned gradient chunk; with `weighted`, only groups whose
        norm weight is not 0. Chunks whose (group, index) is in `lazy` are not brought in (the caller
        does not read them)."""
        mgr = self.model.manager
        for g, group in enumerate(self.model.chunks[self._grad_kind()]):
            if weighted and self.model.norm_weights[g] == 0:
                continue
            for i in self.model.owned_indices(g):
                chunk = group[i]
                if chunk.used == 0:
                    continue
                if (g, i) in lazy:
                    yield g, i, chunk, chunk.used
                    continue
                mgr.access(chunk.chunk_id)
                try:
                    yield g, i, chunk, chunk.used
                finally:  # also when the consumer stops early (`any` in has_overflow)
                    mgr.release(chunk.chunk_id)

    def grad_norm(self) -> float:
        """Global L2 norm of all (still scaled) gradients: one pass over the gradient chunks.

        Each parameter group's sum of squares enters with its norm weight (a group replicated on
        the ranks of an outer group counts on one of them), then the sum is reduced over the shard
        group and the model's outer groups."""
        return math.sqrt(self.model.reduce_sq(self._weighted_sumsq()))

    def _weighted_sumsq(self, known: dict[tuple[int, int], float] | None = None) -> float:
        """This rank's weighted sum of squares, chunk by chunk in list order (a chunk's term from
        `known` where given: the overlapped step's, taken before the gradient was overwritten)."""
        w, known = self.model.norm_weights, known or {}

        def term(g: int, i: int, chunk: object, n: int) -> float:
            got = known.get((g, i))
            return got if got is not None else kernels.sumsq(chunk.payload[:n])  # type: ignore[attr-defined]

        return sum(w[g] * term(g, i, c, n) for g, i, c, n in self._each_grad(weighted=True, lazy=known))

    def has_overflow(self) -> bool:
        """True if any gradient on any rank (shard and outer groups) is inf/NaN."""
        return self.model.reduce_any(self._local_overflow())

    def _local_overflow(self, skip: dict | set = frozenset()) -> bool:
        """True if a gradient on this rank is inf/NaN (chunk groups in `skip` not looked at)."""
        with closing(self._each_grad(lazy=skip)) as grads:  # stopping at the first overflow releases its chunk
            return any(kernels.has_nonfinite(c.payload[:n]) for g, i, c, n in grads if (g, i) not in skip)  # type: ignore[index]

    def nonfinite_params(self) -> list[str]:
        """Names of the parameters whose gradient (in this rank's chunks) holds inf/NaN, in chunk
        order: which layers overflowed, for the message of a skipped fp16 step."""
        names = []
        for _, _, chunk, n in self._each_grad():
            if kernels.has_nonfinite(chunk.payload[:n]):  # type: ignore[index]
                names += [s.name for s in chunk.slots if kernels.has_nonfinite(chunk.view(s))]
        return names

    def step(self, grad_clip: float | None = None, loss_scale: float = 1.0,
             check_overflow: bool = False) -> tuple[float | None, bool]:
        """One AdamW step over every owned chunk group. Returns (gradient norm or None, overflow).

        loss_scale: the factor the loss was multiplied by (fp16); gradients are divided by it.
        check_overflow: skip the whole step (and restore 16-bit parameters) if any gradient is inf/NaN.
        After `arm` (overlap=True) the arguments must be those given to it, and the norm is also
        returned without clipping (divided by the loss scale, as the caller would divide `grad_norm`).
        """
        if self.armed:
            assert self.speculation is not None
            s = self.speculation
            if (s.grad_clip, s.loss_scale, s.check_overflow) != (grad_clip, loss_scale, check_overflow):
                raise ValueError("step() arguments differ from those given to arm()")
            norm, overflow = s.finish()
        else:
            self.flush_pending()
            norm, overflow = self._plain_step(grad_clip, loss_scale, check_overflow)
        if self.speculation is not None:
            self.speculation.saw(grad_clip, norm, overflow)
        return norm, overflow

    def _plain_step(self, grad_clip: float | None, loss_scale: float,
                    check_overflow: bool) -> tuple[float | None, bool]:
        self.overflowed = []
        if check_overflow and self.has_overflow():
            self.overflowed = self.nonfinite_params()  # before the gradients are dropped
            self._restore_params()
            self._drop_grads()
            return None, True
        unscale = 1.0 / loss_scale
        norm = self.grad_norm() * unscale if grad_clip is not None else None
        self._clipped_update(unscale, grad_clip, norm)
        return norm, False

    def _clipped_update(self, unscale: float, grad_clip: float | None, norm: float | None,
                        defer: bool = False) -> None:
        """The step after backward, with the (unscaled) gradient norm known: the update, its gradients
        multiplied by `unscale` and clipped to `grad_clip`, then the gradients dropped. `defer`: each chunk
        group's update is left pending for the next forward instead (module docstring)."""
        if grad_clip is not None and norm is not None and norm > grad_clip:
            unscale *= grad_clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
        if defer:
            for g, hp, i, _, _ in self._chunk_groups():
                self.pending[(g, i)] = self._args(hp, unscale)
            self.model.pending_update = self.run_pending if self.pending else None
            return
        self._update(unscale)
        self._drop_grads()

    def run_pending(self, g: int, i: int) -> None:
        """Chunk group (g, i)'s pending update, if it has one, then its gradient dropped (as `_drop_grads`)."""
        if (g, i) not in self.pending:
            return
        mgr = self.model.manager
        ids = [self.model.chunks[k][g][i].chunk_id for k in self.speculation._kinds(g, i)] if self.speculation else []
        if ids and not mgr.could_pin(ids):  # overlap.defer_fits leaves room for this: a model it misjudged
            raise BudgetError(f"cpu budget of {mgr.cpu.capacity} bytes cannot hold chunk group ({g}, {i})'s update, "
                              f"left to this forward, beside the chunks forward holds pinned: raise memory.cpu_budget "
                              f"or set memory.overlap_optimizer = false (the update then runs after backward)")
        args = self.pending.pop((g, i))
        if not self.pending:
            self.model.pending_update = None
        n = self.model.chunks[ChunkKind.PARAM][g][i].used
        self._update_group(g, i, n, args)
        self.model.manager.free(self.model.chunks[ChunkKind.GRAD][g][i].chunk_id, lazy=not self.model.resident_grads)
        self.deferred_run += 1

    def flush_pending(self) -> None:
        """Run every pending update now, in list order (module docstring: for whatever reads the states
        between steps)."""
        if not self.pending:
            return
        for g, i in list(self.pending):
            self.run_pending(g, i)
        if self.speculation is not None:
            self.speculation.flushed()

    def _chunk_groups(self, skip: set[tuple[int, int]] | frozenset = frozenset()):  # noqa: ANN202
        """(group, its AdamGroup, chunk index, PARAM chunk, used elements) of every owned chunk group to
        step, in list order, but padding chunks and those in `skip`; every group's step count advances
        as the iteration starts (the caller iterates to the end). A parameter group's side list
        (`ChunkedModel.list_group`) steps with its hyper-parameters."""
        for hp in self.groups:
            hp.step += 1
        for g in range(len(self.model.list_group)):
            hp = self.groups[self.model.list_group[g]]
            for i in self.model.owned_indices(g):
                p_chunk = self.model.chunks[ChunkKind.PARAM][g][i]
                if p_chunk.used and (g, i) not in skip:  # (padding of a sharded list; stepped during backward)
                    yield g, hp, i, p_chunk, p_chunk.used

    def _update(self, unscale: float, skip: set[tuple[int, int]] | frozenset = frozenset()) -> None:
        """AdamW over every owned chunk group but those in `skip` (stepped already, overlap.py), with
        gradients multiplied by `unscale`; every group's step count advances."""
        device = self.model.manager.device_tier
        for g, hp, i, p_chunk, n in self._chunk_groups(skip):
            self._update_group(g, i, n, self._args(hp, unscale))
            device.write_through(p_chunk.chunk_id)  # its copy up runs under the next groups' updates

    @staticmethod
    def _args(hp: AdamGroup, unscale: float) -> dict:
        """The kernel's arguments for a group at its current step count and learning rate."""
        return dict(step=hp.step, lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1], eps=hp.eps,
                    weight_decay=hp.weight_decay, adamw=True, grad_scale=unscale)

    def _update_group(self, g: int, i: int, n: int, args: dict) -> None:
        """One chunk group's AdamW: its siblings pinned together, the kernel, released."""
        mgr, chunks, mixed = self.model.manager, self.model.chunks, self.model.mixed
        master_kind = ChunkKind.MASTER if mixed else ChunkKind.PARAM
        kinds = (master_kind, self._grad_kind(), ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)
        ids = [chunks[k][g][i].chunk_id for k in kinds]
        master, grad, m, v = (self.model.step_view(k, mgr.access(cid, write=True).payload, n)  # type: ignore[arg-type]
                              for k, cid in zip(kinds, ids, strict=True))
        spans = self.model.moment_layout(g, i)  # (cached per chunk)
        if mixed:  # update fp32 master, write the 16-bit parameter in the same pass
            p_id = chunks[ChunkKind.PARAM][g][i].chunk_id
            out = mgr.access(p_id, write=True).payload[:n]  # type: ignore[index]
            step_chunk(kernels.adam_update_and_cast, (master, grad, m, v, out), args, spans)
            mgr.release(p_id)
        else:
            step_chunk(kernels.adam_update, (master, grad, m, v), args, spans)
        for cid in ids:
            mgr.release(cid)

    def _drop_grads(self) -> None:
        """Gradients are consumed: free gradient chunks (zero_grad), clear slot-reuse marks."""
        if self.model.grad_chunks:
            # Cleared when next accessed, or never where the reduction overwrites them (sharding.py);
            # not where param.grad is bound to the chunk (autograd adds into it unseen).
            lazy = not self.model.resident_grads
            for g, group in enumerate(self.model.chunks[ChunkKind.GRAD]):
                for i in self.model.owned_indices(g):
                    self.model.manager.free(group[i].chunk_id, lazy=lazy)
        for home in self.model.homes.values():
            home.grad_in_slot = False

    def _restore_params(self) -> None:
        """After an overflow in slot-reuse mode the PARAM slots hold gradients: cast masters back."""
        if not self.model.mixed or self.model.grad_chunks:
            return
        mgr, chunks = self.model.manager, self.model.chunks
        for g, group in enumerate(chunks[ChunkKind.PARAM]):
            for i in self.model.owned_indices(g):
                n = group[i].used
                if n == 0:
                    continue
                master = mgr.access(chunks[ChunkKind.MASTER][g][i].chunk_id)
                param = mgr.access(group[i].chunk_id, write=True)
                kernels.cast_(master.payload[:n], param.payload[:n])  # type: ignore[index]
                mgr.release(param.chunk_id)
                mgr.release(master.chunk_id)
