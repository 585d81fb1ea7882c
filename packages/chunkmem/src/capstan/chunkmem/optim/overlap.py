"""The CPU optimizer step overlapped with backward, exactly (ZeRO-Offload's CPU Adam, made concurrent).

Without overlap the Adam step of every chunk waits for the end of backward,
because clipping needs the global gradient norm and fp16 needs the global
inf/NaN check, both known only then (the GPU idles through the CPU step: 4 s
of a 7 s Llama-2-7B ZeRO-Offload step, PRIOR_ART.md section 5). Here a chunk
group (master, gradient, moments) is stepped on a worker thread as soon as
backward has produced all of its gradients, while backward goes on, under the
assumption that neither clipping nor an overflow will change the step
(SuperOffload's speculation-then-validation; clipping fired in 0.12% of
BLOOM-176B's steps). At the end of backward `finish` validates:

* the norm is the sum of the per-chunk sums of squares taken before each
  speculative update, added in the order `ChunkAdam.grad_norm` adds them, so
  it is the same float;
* no overflow and no clipping: the speculative updates are the step, bit for
  bit what `ChunkAdam.step` computes (same kernel, same arguments); the
  chunks not stepped yet are stepped now;
* clipping or an overflow: every speculatively stepped chunk is put back from
  the copy taken just before its update (master, both moments, and the
  16-bit slot where it held the gradient), and the ordinary step runs: the
  clipped update, or the skipped one.

So the result is always the non-overlapped step's, and the price of a wrong
guess is one more pass of Adam over the chunks, plus the copies. Clipping is
not rare everywhere: early in training, or on data like a benchmark's random
tokens, every step clips, and a guess made every step then made every step
cost two passes of Adam and 24-28 bytes of copies per parameter (the H200's
1B offload step: 379 ms of host copies in 2,161 ms, docs/benchmarks.md
"GPU"). So a step guesses only when the step before it neither clipped nor
overflowed (`expect_wrong`); otherwise it steps after backward, once, and
its norm says whether the next one guesses. Such a step is still armed, to
measure only (`arm(..., update=False)`): the worker takes each chunk's sum
of squares (and inf/NaN check) as its gradients complete, during backward,
so after backward the norm needs no pass over the gradients and no wait for
all of them to come off the device, only the one Adam pass (the H200's 1B
offload step spent 68 ms of 335 in that norm pass, 49 of them waiting for
copies). Both paths give the same step, bit for bit. The copies cost RAM: 12 bytes
per parameter with fp32 moments (14 where the gradient shares the 16-bit slot; 8 and 6 with bf16 and
8-bit moments, and the 8-bit ones' scales) while a step is
in flight, counted in the cpu tier; with grad_clip 0 and no loss scaling no
guess can be wrong and nothing is copied. Where the machine's RAM cannot hold
the copies (`copy_room`, the bytes RAM can still take, read at each step: a
guess only where the copies take at most half of it; past RAM, where the
disk cannot take the second slots below) the step does not guess
but measures, bit for bit the same: without this, the largest model
that fits RAM once was killed by the host's out-of-memory killer in its first
step, which guessed (an H200's scale probe, 6.9B parameters with 134 GB of
RAM free: docs/benchmarks.md, "GPU").

Threads: the worker only runs native kernels (which release the GIL) on chunk
buffers pinned before the job is queued; every manager call (access,
release, reservations) is made by the thread that runs backward's hooks:
the caller of backward() on the CPU, autograd's device thread on a GPU (and
on the stand-in accelerator, which the suite runs this on). Never two at
once: the caller waits in backward() while the device thread runs, and
`finish` runs after it returns. The prefetch to the device skips chunks
pinned in RAM, so a chunk the worker reads is never moved under it. Speculation
needs chunks that never move while pinned RAM is full of them: the manager
must have no RAM budget and no disk tier (a device tier is fine: chunks come
off the GPU when their gradients are complete).

Past RAM (a cpu budget or a disk tier) the chunk groups cannot stay pinned
until the step's end, nor can their copies stay in RAM: the step *streams*
instead (`streams`). A chunk group's work runs as soon as its gradients are
complete, in the thread that runs backward's hooks (every manager call
stays there), and its chunks are released at once, so the manager evicts
and reads ahead around them; their accesses are part of the warm-up trace,
so the moments are read ahead of backward like any other chunk:

* with neither clipping nor loss scaling (no step can be redone) the group
  is updated then and there, bit for bit as after backward, and its
  gradient chunk dropped: it is never written to disk or read back, and
  the norm is taken from it first;
* with either, it guesses as above, and the copies to roll back to are the
  disk's: the chunks are protected first (`ChunkManager.rollback`: their
  write-backs go to a second slot of the disk file while the first keeps the
  data from before the update, and data only in RAM is written to its slot
  first). The gradient chunk is kept until the step's end. A right guess
  lets the first slots go (`commit`); a wrong one drops what the update
  wrote, wherever it is, and the ordinary step runs from the kept
  gradients and the data from before (`restore`). So a guess costs no copy
  in RAM, only the gradients' write-back where the budget evicts them, and
  at most once more the states' bytes of disk;
* a step that does not guess (the one before clipped or overflowed, or a
  cpu budget without a disk tier: no slots to keep the old data in) takes
  each group's norm term and inf/NaN check during backward ("measure
  only"), so the step after backward needs no pass over the gradients for
  the norm: one read of every gradient chunk less per step.

On disk a measuring step does not update after backward either: it leaves
each chunk group's update pending, with its arguments and clip coefficient,
and the next forward runs it just before it first uses the group's
parameters (`ChunkAdam.pending`, adam.py). Its parameters are read then for
the update and for forward at once, so a step where every step clips reads
the parameters twice (forward, backward) instead of three times, and the
whole update runs under forward's compute instead of after backward with
nothing to hide its I/O behind. The update is the same call on the same
bytes, so the trajectory is the same bit for bit.

Guessing and measuring steps, and steps that begin with pending updates, touch
chunks in different orders, so each kind runs on its own trace
(`ChunkManager.use_trace`: the first such step records its own, as the warm-up
recorded the first). Where a group's chunks do not
fit in the budget beside those backward has pinned (`ChunkManager.could_pin`),
it is left to the step after backward, as without streaming: the minimum
budget stays what either needs alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from capstan.native import kernels

from ..model.moment_layout import Q8Layout
from ..model.states import ChunkKind
from .moments import step_chunk

if TYPE_CHECKING:
    from .adam import ChunkAdam

__all__ = ["Speculation", "can_overlap", "streams", "defer_fits"]


def defer_fits(budget: int, group_bytes: int) -> bool:
    """Whether a cpu budget leaves room to run an update left to forward (adam.py, "Deferred update"): the
    update pins one chunk group's siblings beside what forward holds pinned then (the chunks of the modules
    enclosing the one about to run), so the budget must hold two of the largest groups, not one (what the
    step after backward needs). The planner's replay follows the same rule (engine plan/chunks.py)."""
    return budget >= 2 * group_bytes


def can_overlap(model: object) -> str | None:
    """None if `model`'s optimizer step can overlap its backward, else why not."""
    from ..parallel.sharding import ShardedChunkedModel

    if isinstance(model, ShardedChunkedModel):
        return "sharded chunks (ZeRO-3) reduce their gradients to their owners at the end of each unit"
    return None


def streams(model: object) -> bool:
    """Whether chunks may move between RAM and disk (a cpu budget or a disk tier): the step then streams
    (module docstring, "Past RAM")."""
    mgr = model.manager  # type: ignore[attr-defined]
    return mgr.cpu.capacity is not None or mgr.disk is not None


def _adam(views: list[torch.Tensor], args: dict, spans: list | Q8Layout, mixed: bool) -> None:
    """One chunk group's update over the views `_kinds` lists (mixed: the 16-bit output is the fifth view,
    or the gradient's slot)."""
    master, grad, m, v = views[:4]
    if mixed:
        out = views[4] if len(views) > 4 else grad
        step_chunk(kernels.adam_update_and_cast, (master, grad, m, v, out), args, spans)
    else:
        step_chunk(kernels.adam_update, (master, grad, m, v), args, spans)


@dataclass
class _Job:
    """One speculatively stepped chunk group: its pinned chunks, the copies to roll back to, the result."""

    group: int
    index: int
    n: int
    ids: list[int]  # pinned chunk ids (released by `_settle`)
    landing: list = field(default_factory=list)  # copies from the device into these chunks still in flight
    backup: list[torch.Tensor] | None = None  # master, exp_avg, exp_avg_sq[, the 16-bit gradient slot]
    backup_bytes: int = 0
    future: Future | None = None
    sumsq: float = 0.0
    nonfinite: bool = False
    stepped: bool = False
    spans: list | Q8Layout = field(default_factory=list)  # the chunk's moment_layout (moments.py)
    protected: list[int] = field(default_factory=list)  # streamed guess: chunks whose disk slots keep the old data
    empty: set[int] = field(default_factory=set)  # ... of those, the ones that had no data (restored as zeros)


@dataclass
class Speculation:
    """The overlapped step of one `ChunkAdam` (see the module docstring); armed once per step."""

    opt: ChunkAdam
    grad_clip: float | None = None
    loss_scale: float = 1.0
    check_overflow: bool = False
    arrivals: int = 1
    armed: bool = False
    jobs: dict[tuple[int, int], _Job] = field(default_factory=dict)
    missing: dict[tuple[int, int], int] = field(default_factory=dict)
    # Counters for tests and the run log: chunk groups stepped during backward, steps redone, steps that
    # did not guess because the one before clipped or overflowed.
    stepped_early: int = 0
    rollbacks: int = 0
    declined: int = 0
    measured_early: int = 0  # chunk groups whose norm term a measuring (non-guessing) step took during backward
    measuring: bool = False  # armed to measure only: this step does not guess (`expect_wrong`)
    last_wrong: bool = False  # the last step clipped or overflowed: a guess now would likely be wrong too

    copy_room: Callable[[], int] | None = None  # bytes RAM can still take (None: unlimited); see the docstring
    disk_room: Callable[[], int] | None = None  # bytes the disk can still take (None: the disk tier's free bytes)
    no_room: int = 0  # steps that measured instead of guessing: RAM could not hold their copies
    streamed: int = 0  # chunk groups updated during backward past RAM (streaming: never guesses)
    deferred: int = 0  # ... and left to the step after backward: they did not fit beside backward's chunks

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capstan-adam")
        self._disk_ids: tuple[dict[int, int], set[int]] | None = None  # (`_disk_fits`)
        self._copy_bytes: int | None = None  # (`copy_bytes`)
        self._disk_short: bool | None = None  # `_retrace`'s verdict for the next step (`_disk_room_now`)
        # (group, index) -> the last guess's copies and their bytes, reused by the next guess: a guess that
        # stands every step made and freed 12 B a parameter each step, and the free alone (the pages given
        # back) took ~120 ms of the main thread's step at 134M parameters (the stand-in; the H200's
        # offload step of 97.9 ms spent 32 ms in `_settle`), the worker's first touch of new pages more
        self._spare: dict[tuple[int, int], tuple[list[torch.Tensor], int]] = {}
        self._overflowed = False
        self.streaming = streams(self.opt.model)
        # past RAM a guess is taken back from disk slots: a cpu budget without a disk tier never guesses
        self.guesses_on_disk = self.streaming and self.opt.model.manager.disk is not None
        # ... and a measuring step leaves its update to the next forward (module docstring); not where the
        # 16-bit parameter slot holds the gradient (forward reads that slot), nor where the manager follows
        # one trace's per-moment measurements (a RAM or device limit: forward's moments would shift)
        mgr = self.opt.model.manager
        self.defers = (self.guesses_on_disk and self.opt.model.grad_chunks and mgr.traces_per_kind()
                       and defer_fits(mgr.cpu.capacity, self._largest_group()))

    def _largest_group(self) -> int:
        """Bytes of the largest chunk group's siblings (what its update pins together)."""
        chunks = self.opt.model.chunks
        return max((sum(chunks[k][g][i].nbytes for k in self._kinds(g, i))
                    for g, lst in enumerate(chunks[ChunkKind.PARAM]) for i in range(len(lst))), default=0)

    # ---- whether to guess --------------------------------------------------------------------------
    def expect_wrong(self, grad_clip: float | None, check_overflow: bool) -> bool:
        """True (and counted) when this step should not guess: the last one clipped or overflowed, and this
        one can roll back (with neither clipping nor loss scaling no guess is ever wrong)."""
        if self.last_wrong and (grad_clip is not None or check_overflow):
            self.declined += 1
            return True
        return False

    def saw(self, grad_clip: float | None, norm: float | None, overflow: bool) -> None:
        """After every step, guessed or not: did it clip or overflow (what `expect_wrong` reads next)?"""
        self.last_wrong = overflow or (grad_clip is not None and norm is not None and norm > grad_clip)
        self._retrace()

    def flushed(self) -> None:
        """The pending updates ran before the next step (`ChunkAdam.flush_pending`): its forward has none."""
        self._retrace(now=True)

    def _retrace(self, now: bool = False) -> None:
        """The next step's trace: whether it measures or guesses, and whether its forward runs updates."""
        if self.guesses_on_disk:
            # a step that would guess but finds no disk room for its second slots measures: decided here,
            # where its trace is chosen, and kept for `arm`, so the step runs on the trace of its kind
            self._disk_short = not self.last_wrong and self._may_roll_back() and not self._disk_fits()
            measure = self.last_wrong or self._disk_short
            key = ("deferred " if self.opt.pending else "") + ("measure" if measure else "guess")
            self.opt.model.manager.use_trace(None if key == "guess" else key, now=now)

    # ---- arming and the gradient hook ----------------------------------------------------------------
    def arm(self, grad_clip: float | None, loss_scale: float, check_overflow: bool, arrivals: int = 1,
            update: bool = True) -> None:
        """Before the backward that completes this step's gradients: from now on a chunk group whose
        parameters all got `arrivals` gradients is stepped at once (the learning rates must be set);
        with `update=False` only its norm term and inf/NaN check are taken (a step that does not guess)."""
        if self.armed:
            raise RuntimeError("speculative step armed twice without finish()")
        self.grad_clip, self.loss_scale, self.check_overflow = grad_clip, loss_scale, check_overflow
        self.arrivals, self.armed, self.measuring = arrivals, True, not update
        if self.streaming and not self.guesses_on_disk:
            self.measuring = self.measuring or self._may_roll_back()
        elif not self.measuring and self._may_roll_back() and not (
                self._disk_room_now() if self.streaming else self._copies_fit()):
            self.measuring, self.no_room = True, self.no_room + 1
        if self.measuring or not self._may_roll_back():
            self.drop_spares()  # no copies this step: their RAM back
        self._overflowed = False  # set by the worker at the first inf/NaN gradient it meets
        model = self.opt.model
        self.missing = {}
        for home in model.homes.values():
            if home.param.requires_grad:
                key = (home.group, home.index)
                self.missing[key] = self.missing.get(key, 0) + arrivals
        model.grad_listener = self._arrived

    def _arrived(self, group: int, index: int) -> None:
        key = (group, index)
        left = self.missing.get(key)
        if left is None:
            return
        left -= 1
        self.missing[key] = left
        if left == 0 and key not in self.jobs:
            self._submit(group, index)

    # ---- one chunk group ------------------------------------------------------------------------------
    def _submit(self, g: int, i: int) -> None:
        opt, model = self.opt, self.opt.model
        chunks, mgr = model.chunks, model.manager
        p_chunk = chunks[ChunkKind.PARAM][g][i]
        n = p_chunk.used
        if n == 0:
            return
        if self.streaming:
            self._stream(g, i, n)
            return
        if self.measuring:  # the gradient only, read: its norm term and inf/NaN check
            cid = chunks[opt._grad_kind()][g][i].chunk_id
            view = mgr.access(cid, wait=False).payload[:n]  # type: ignore[index]
            job = _Job(g, i, n, [cid], landing=[ev for ev in [mgr.device_tier.landing(cid)] if ev is not None])
            job.future = self._pool.submit(self._measure, job, view)
            self.jobs[(g, i)] = job
            return
        kinds = self._kinds(g, i)
        ids = [chunks[k][g][i].chunk_id for k in kinds]
        # Chunks coming off a GPU land in RAM while backward goes on: the worker waits for the copies.
        views = [model.step_view(k, mgr.access(cid, write=True, wait=False).payload, n)  # type: ignore[arg-type]
                 for k, cid in zip(kinds, ids, strict=True)]
        job = _Job(g, i, n, ids, landing=[ev for ev in map(mgr.device_tier.landing, ids) if ev is not None])
        slot_reuse = model.mixed and not model.grad_chunks
        if self._may_roll_back():
            # master, exp_avg, exp_avg_sq (8-bit ones with their scales), and the 16-bit slot the kernel
            # overwrites with the parameter when it holds the gradient, each in its own dtype: the last
            # guess's buffers where it left them (`_spare`), else new ones
            saved = [views[0], views[2], views[3]] + ([views[1]] if slot_reuse else [])
            spare = self._spare.pop((g, i), None)
            if spare is not None and [(t.shape, t.dtype) for t in spare[0]] == [(t.shape, t.dtype) for t in saved]:
                job.backup, job.backup_bytes = spare
            else:
                if spare is not None:
                    mgr.release_transient(spare[1])
                job.backup_bytes = sum(t.numel() * t.element_size() for t in saved)
                mgr.reserve_transient(job.backup_bytes, f"rollback copy of chunk group ({g}, {i})")
                job.backup = [torch.empty_like(t) for t in saved]
        job.spans = model.moment_layout(g, i)  # (main thread: the model's bookkeeping stays here)
        job.future = self._pool.submit(self._work, job, views, self._args(g), model.mixed)
        self.jobs[(g, i)] = job

    def copy_bytes(self) -> int:
        """Bytes a guessing step copies in RAM at most: each chunk group's master, both moments and, where
        the 16-bit slot holds the gradient, that slot (whole chunks: an upper bound by their padding)."""
        if self._copy_bytes is None:  # (the chunks are fixed at build)
            model = self.opt.model
            master = ChunkKind.MASTER if model.mixed else ChunkKind.PARAM
            kinds = [master, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ]
            if model.mixed and not model.grad_chunks:
                kinds.append(ChunkKind.PARAM)
            self._copy_bytes = sum(c.nbytes for k in kinds for lst in model.chunks[k] for c in lst)
        return self._copy_bytes

    def _copies_fit(self) -> bool:
        """Whether RAM can take this step's copies: at most half of what it can still take (the rest is
        left to what the step lands in RAM meanwhile and to the rest of the process)."""
        held = sum(nbytes for _, nbytes in self._spare.values())  # (already taken from what RAM has)
        return self.copy_room is None or 2 * (self.copy_bytes() - held) <= self.copy_room()

    def _disk_room_now(self) -> bool:
        """`_disk_fits` as `_retrace` decided it when it chose this step's trace (else asked now)."""
        short, self._disk_short = self._disk_short, None
        return not short if short is not None else self._disk_fits()

    def _disk_fits(self) -> bool:
        """Past RAM: whether the disk can take the second slots a guess writes its updates to (and the first
        slots not written yet), at most 90% of its free bytes (`disk_room`: this rank's share of them); else
        the step measures (the module docstring: a disk probe of 5.2B parameters on 69 GB free ran out of
        disk without this)."""
        model = self.opt.model
        if self._disk_ids is None:  # every chunk's bytes, and the chunks a guess protects (fixed at build)
            grad_kind = self.opt._grad_kind()
            chunks = {c.chunk_id: c.nbytes for lst_of in model.chunks.values() for lst in lst_of for c in lst}
            second = {model.chunks[k][g][i].chunk_id for g, lst in enumerate(model.chunks[ChunkKind.PARAM])
                      for i in range(len(lst)) for k in self._kinds(g, i)
                      if k != grad_kind or not model.grad_chunks}
            self._disk_ids = (chunks, second)
        disk = model.manager._disk()
        room = self.disk_room() if self.disk_room is not None else disk.free_bytes()
        return disk.growth(*self._disk_ids) <= 0.9 * room

    def _kinds(self, g: int, i: int) -> list[ChunkKind]:
        """The chunks a group's update reads and writes: master, gradient, both moments, and the 16-bit
        output where it is not the gradient's slot."""
        model = self.opt.model
        master_kind = ChunkKind.MASTER if model.mixed else ChunkKind.PARAM
        kinds = [master_kind, self.opt._grad_kind(), ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ]
        ids = [model.chunks[k][g][i].chunk_id for k in kinds]
        if model.mixed and model.chunks[ChunkKind.PARAM][g][i].chunk_id not in ids:
            kinds.append(ChunkKind.PARAM)
        return kinds

    def _args(self, g: int) -> dict:
        hp = self.opt.groups[self.opt.model.list_group[g]]
        return dict(step=hp.step + 1, lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1], eps=hp.eps,
                    weight_decay=hp.weight_decay, adamw=True, grad_scale=1.0 / self.loss_scale)

    def _stream(self, g: int, i: int, n: int) -> None:
        """Past RAM: the group's work now, in this (the hooks') thread, its chunks released when done
        (module docstring). Its `_Job` carries the norm term, as a worker's would."""
        opt, model = self.opt, self.opt.model
        chunks, mgr = model.chunks, model.manager
        job = _Job(g, i, n, [])
        grad_id = chunks[opt._grad_kind()][g][i].chunk_id
        if self.measuring:
            try:
                self._measure(job, mgr.access(grad_id).payload[:n])  # type: ignore[index]
            finally:
                mgr.release(grad_id)
        else:
            kinds = self._kinds(g, i)
            ids = [chunks[k][g][i].chunk_id for k in kinds]
            if not mgr.could_pin(ids):  # not beside what backward holds now: the step after backward does it
                self.deferred += 1
                return
            guess = self._may_roll_back()
            if guess:  # the update can be taken back: its chunks' old data stays in their disk slots
                grad_kind = opt._grad_kind()
                job.protected = [cid for k, cid in zip(kinds, ids, strict=True)
                                 if k != grad_kind or not model.grad_chunks]  # (a gradient chunk is kept)
            views: list[torch.Tensor] = []
            try:
                for k, cid in zip(kinds, ids, strict=True):  # pinned one by one: none evicts another
                    views.append(model.step_view(k, mgr.access(cid, write=not guess).payload, n))  # type: ignore[arg-type]
                job.sumsq = kernels.sumsq(views[1])
                job.nonfinite = self.check_overflow and kernels.has_nonfinite(views[1])
                self._overflowed = self._overflowed or job.nonfinite  # the step will be skipped: no more updates
                if not self._overflowed:
                    if guess:
                        job.empty = mgr.rollback.protect(job.protected)
                        mgr.rollback.mark_written(job.protected)
                    _adam(views, self._args(g), model.moment_layout(g, i), model.mixed)
                    job.stepped = True
            finally:
                for cid in ids[: len(views)]:
                    mgr.release(cid)
            if not job.stepped:
                job.protected = []
            elif model.grad_chunks and not guess:  # consumed: dropped now, never written back
                mgr.free(grad_id, lazy=not model.resident_grads)
            self.streamed += job.stepped
        job.future = Future()
        job.future.set_result(None)
        self.jobs[(g, i)] = job

    def _work(self, job: _Job, views: list[torch.Tensor], args: dict, mixed: bool) -> None:
        """On the worker thread: the chunk's norm term and overflow check, the copies, the update."""
        self._landed(job)
        master, grad, m, v = views[:4]
        job.sumsq = kernels.sumsq(grad)
        job.nonfinite = self.check_overflow and kernels.has_nonfinite(grad)
        if job.nonfinite:
            self._overflowed = True  # the step will be skipped: stop updating (each would be rolled back)
        if self._overflowed:
            return
        if job.backup is not None:
            for copy, t in zip(job.backup, (master, m, v, grad)):
                copy.copy_(t)
        _adam(views, args, job.spans, mixed)
        job.stepped = True

    def _measure(self, job: _Job, grad: torch.Tensor) -> None:
        """On the worker thread, for a step that does not guess: the chunk's norm term and overflow check."""
        self._landed(job)
        job.sumsq = kernels.sumsq(grad)
        job.nonfinite = self.check_overflow and kernels.has_nonfinite(grad)

    @staticmethod
    def _landed(job: _Job) -> None:
        """On the worker thread: wait for the copies off the device into the job's chunks."""
        for event in job.landing:
            event.synchronize()  # type: ignore[attr-defined]

    def _may_roll_back(self) -> bool:
        return self.grad_clip is not None or self.check_overflow

    # ---- the end of the step ----------------------------------------------------------------------------
    def finish(self) -> tuple[float | None, bool]:
        """At the step (after backward): validate the speculation and complete the step exactly.
        Returns what `ChunkAdam.step` returns: (the unscaled gradient norm or None, overflow)."""
        if not self.armed:
            raise RuntimeError("finish() without arm()")
        self.armed = False
        self.opt.model.grad_listener = None
        self._join()
        self.stepped_early += sum(j.stepped for j in self.jobs.values())
        opt, model = self.opt, self.opt.model
        known = {k: j.sumsq for k, j in self.jobs.items()}
        overflow = False
        if self.check_overflow:
            local = any(j.nonfinite for j in self.jobs.values()) or opt._local_overflow(skip=self.jobs)
            overflow = model.reduce_any(local)
        norm = None
        unscale = 1.0 / self.loss_scale
        if not overflow:
            raw = math.sqrt(model.reduce_sq(opt._weighted_sumsq(known)))
            # As the plain step reports it: times 1/scale with clipping, else what the caller divides.
            norm = raw * unscale if self.grad_clip is not None else raw / self.loss_scale
        clipped = self.grad_clip is not None and norm is not None and norm > self.grad_clip
        if self.measuring and not overflow:  # no guess was made: one pass of Adam, clipped as the plain step clips
            self.measured_early += len(self.jobs)
            self._settle()
            opt.overflowed = []
            opt._clipped_update(unscale, self.grad_clip, norm, defer=self.defers)  # on disk: in the next forward
            return norm, False
        if overflow or clipped:  # the guess was wrong: undo it, and take the ordinary step
            stepped = [j for j in self.jobs.values() if j.stepped]
            self.rollbacks += bool(stepped)
            for job in stepped:
                self._roll_back(job)
            self._settle()
            return opt._plain_step(self.grad_clip, self.loss_scale, self.check_overflow)
        # The guess held: the speculative updates are the step's; the rest are stepped now, alike.
        done = {k for k, j in self.jobs.items() if j.stepped}
        self._settle()
        opt._update(unscale, skip=done)
        self._write_through(done)
        opt._drop_grads()
        return norm, False

    def _join(self) -> None:
        """Wait for the worker's jobs (a method of its own, so a profile shows the wait: tools/gpu/profile_step.py)."""
        for job in self.jobs.values():
            job.future.result()  # type: ignore[union-attr]  # re-raises a kernel's error here

    def _write_through(self, done: set[tuple[int, int]]) -> None:
        """The parameter chunks stepped during backward, kept now: copied up to the device as `_update` copies
        those it steps (write-through), after them, so the first layers, which the next forward needs first,
        had the room first. (During backward they could not go up: a rollback would rewrite them in RAM.)"""
        tier, params = self.opt.model.manager.device_tier, self.opt.model.chunks[ChunkKind.PARAM]
        for g, i in sorted(done):
            tier.write_through(params[g][i].chunk_id)

    def _roll_back(self, job: _Job) -> None:
        """Put a speculatively stepped chunk group back as it was before its update."""
        model, n = self.opt.model, job.n
        if job.protected:  # streamed: the data from before is in the chunks' disk slots
            model.manager.rollback.restore(job.protected, job.empty)
            job.protected = []
            return
        chunks = model.chunks
        g, i = job.group, job.index
        master_kind = ChunkKind.MASTER if model.mixed else ChunkKind.PARAM
        kinds = [master_kind, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ]
        assert job.backup is not None
        for copy, kind in zip(job.backup, kinds):
            model.step_view(kind, chunks[kind][g][i].payload, n).copy_(copy)  # type: ignore[arg-type]
        if len(job.backup) == 4:  # the slot held the gradient: put it back
            chunks[ChunkKind.PARAM][g][i].payload[:n].copy_(job.backup[3])  # type: ignore[index]
        elif model.mixed:  # the 16-bit parameter was written from the new master: write it from the old
            kernels.cast_(chunks[ChunkKind.MASTER][g][i].payload[:n], chunks[ChunkKind.PARAM][g][i].payload[:n])  # type: ignore[index]

    def _settle(self) -> None:
        """Release every job's chunks (main thread); a streamed guess that stands lets the data from before
        its update go. The copies stay for the next guess (`_spare`, still counted in the cpu tier)."""
        mgr = self.opt.model.manager
        for job in self.jobs.values():
            if job.protected:
                mgr.rollback.commit(job.protected)
            for cid in job.ids:
                mgr.release(cid)
            if job.backup is not None:
                self._spare[(job.group, job.index)] = (job.backup, job.backup_bytes)
            job.backup = None
        self.jobs = {}

    def drop_spares(self) -> None:
        """Free the copies kept for the next guess (a step that does not guess, or the end)."""
        mgr = self.opt.model.manager
        for _, nbytes in self._spare.values():
            mgr.release_transient(nbytes)
        self._spare = {}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.drop_spares()
