"""The optimizer step overlapped with backward (overlap.py) equals the ordinary step bit for bit.

Each case trains two copies of one model side by side, one with `ChunkAdam(overlap=True)` (armed
before the backward that completes the gradients), one without, and compares every master weight,
moment and reported norm exactly after every step. The steps alternate between a clip threshold
no gradient reaches (the speculative updates stand) and one every gradient exceeds (all of them are
rolled back and the clipped step redone), so both branches run; fp16 adds steps whose gradients
overflow (rolled back, then skipped).
"""

from __future__ import annotations

import pytest
import torch

from capstan.chunkmem import ChunkAdam, ChunkedModel, ChunkKind, ChunkManager, DynamicLossScaler

CHUNK = 4096  # the net below fills several chunks, so some are complete while backward still runs
PAST_RAM_BUDGET = 10 * CHUNK * 4  # bytes: about a quarter of the net's fp32 chunks (16 B per parameter)
STEPS = 8


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 32),
        torch.nn.LayerNorm(32), torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 64),
    )


def _loss(model: torch.nn.Module, step: int, micro: int, poison: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randint(0, 64, (4, 8), generator=g)
    out = model(x).float()
    if poison:  # an fp16 overflow: inf in every gradient
        out = out * float("inf")
    return torch.nn.functional.cross_entropy(out.reshape(-1, 64), ((x * 3 + 1) % 64).reshape(-1))


def _state(model: ChunkedModel) -> list[torch.Tensor]:
    kinds = [ChunkKind.MASTER if model.mixed else ChunkKind.PARAM, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ,
             ChunkKind.PARAM]
    return [c.payload.clone() for k in kinds for lst in model.chunks[k] for c in lst]


def _alternating(step: int) -> float:
    return 1e9 if step % 2 == 0 else 1e-3  # never / always clipped


def _run(overlap: bool, dtype: torch.dtype, accum: int, fp16_overflow_steps: tuple[int, ...] = (),
         clips=_alternating, disk_dir=None, budget: int = PAST_RAM_BUDGET, read_states: bool = True,
         copy_room=None) -> tuple:
    """disk_dir: chunks past RAM, a `budget` over a disk tier there (the step streams). read_states: the
    states after every step (which runs the updates a measuring step left to the next forward, adam.py);
    else once, after the last."""
    from capstan.chunkmem import DiskStore

    # (reads ahead evict as Belady would, only earlier, which on a budget this small moves up to 15% more
    # bytes: off, so that the bytes compared are the step's own)
    manager = ChunkManager(None, audit=True) if disk_dir is None else ChunkManager(
        budget, DiskStore(disk_dir), audit=True, prefetch_evicts=False)
    model = ChunkedModel(_net(), manager, CHUNK, dtype=dtype, accumulate_grads=accum > 1, report_grads=overlap)
    opt = ChunkAdam(model, lr=1e-2, weight_decay=0.1, overlap=overlap, copy_room=copy_room)
    scaler = DynamicLossScaler(initial_scale=2.0**8, hysteresis=1) if dtype == torch.float16 else None
    norms, states, moved = [], [], []
    stepped = 0  # bytes the steps moved, without the state reads between them
    for step in range(STEPS):
        clip = clips(step)
        scale = scaler.scale if scaler is not None else 1.0
        before = manager.stats()["moved_bytes"]
        manager.begin_step()
        for micro in range(accum):
            if overlap and micro == accum - 1:
                opt.arm(grad_clip=clip, loss_scale=scale, check_overflow=scaler is not None)
            loss = _loss(model, step, micro, poison=step in fp16_overflow_steps and micro == 0) / accum * scale
            model.backward(loss)
        norm, overflow = opt.step(grad_clip=clip, loss_scale=scale, check_overflow=scaler is not None)
        if scaler is not None:
            scaler.update(overflow)
        manager.end_step()
        stepped += manager.stats()["moved_bytes"] - before
        norms.append((norm, overflow))
        if read_states or step == STEPS - 1:
            states.append(_state(model) if disk_dir is None else _state_past_ram(opt))
        moved.append(stepped)
    return norms, states, opt, moved


def _state_past_ram(opt: ChunkAdam) -> list[torch.Tensor]:
    """`_state` read through the manager, one chunk at a time (chunks may be on disk), after the updates left
    to the next forward."""
    model = opt.model
    kinds = [ChunkKind.MASTER if model.mixed else ChunkKind.PARAM, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ,
             ChunkKind.PARAM]
    out, mgr = [], model.manager
    with mgr.off_trace():
        opt.flush_pending()
        for k in kinds:
            for lst in model.chunks[k]:
                for c in lst:
                    out.append(mgr.access(c.chunk_id).payload.clone())
                    mgr.release(c.chunk_id)
    return out


@pytest.mark.parametrize("dtype,accum", [(torch.float32, 1), (torch.bfloat16, 1), (torch.bfloat16, 2),
                                         (torch.float32, 2)])
def test_overlapped_step_equals_the_plain_step(dtype: torch.dtype, accum: int) -> None:
    want_norms, want_states, _, _ = _run(False, dtype, accum)
    got_norms, got_states, opt, _ = _run(True, dtype, accum)
    assert got_norms == want_norms
    for step, (got, want) in enumerate(zip(got_states, want_states)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step} differs"
    spec = opt.speculation
    assert spec.stepped_early > STEPS // 2  # chunk groups really were stepped during backward
    assert spec.rollbacks == STEPS // 2  # and every clipped step was rolled back and redone
    assert spec.declined == STEPS // 2 - 1  # the steps after a clipped one did not guess


def test_after_a_clipped_step_the_next_does_not_guess_until_one_is_not_clipped() -> None:
    """Where every step clips (early training, a benchmark's random tokens) a guess every step costs every
    step a second pass of Adam and the copies (379 ms of a 2,161 ms offload step of a 1B GPT on an H200).
    One wrong guess, then the steps run after backward until one is not clipped; then guessing resumes.
    Every step is still the plain step's, bit for bit."""
    clips = [1e-3] * 5 + [1e9] * 3  # clipped 5 times, then never
    want_norms, want_states, _, _ = _run(False, torch.bfloat16, 1, clips=clips.__getitem__)
    got_norms, got_states, opt, _ = _run(True, torch.bfloat16, 1, clips=clips.__getitem__)
    assert got_norms == want_norms
    for step, (got, want) in enumerate(zip(got_states, want_states)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step} differs"
    spec = opt.speculation
    # step 0 guessed wrong; steps 1-5 stepped after backward (step 5 was the first not clipped); 6-7 guessed
    assert (spec.rollbacks, spec.declined) == (1, 5)
    # Steps 1-5 did not guess, but took every chunk group's norm term during backward: after it, one pass
    # of Adam and no pass over the gradients (the H200's 1B offload step spent 68 of 335 ms in that pass).
    groups = sum(1 for lst in opt.model.chunks[ChunkKind.PARAM] for c in lst if c.used)
    assert groups > 2 and spec.measured_early == 5 * groups


def test_a_step_that_does_not_guess_reads_no_gradient_after_backward() -> None:
    """The norm of a step armed to measure only comes from the terms the worker took during backward:
    after backward, `ChunkAdam` computes no sum of squares (the same float, bit for bit, from the terms)."""
    import threading

    from capstan.native import kernels

    manager = ChunkManager(None, audit=True)
    model = ChunkedModel(_net(), manager, CHUNK, dtype=torch.bfloat16, report_grads=True)
    opt = ChunkAdam(model, lr=1e-2, overlap=True)
    real, calls = kernels.sumsq, []
    for step in range(3):  # step 0 guesses and is clipped; steps 1 and 2 measure only
        manager.begin_step()
        opt.arm(grad_clip=1e-3)
        model.backward(_loss(model, step, 0))
        # the main thread's calls (the worker may still be taking the last terms when backward returns)
        kernels.sumsq = lambda t: (threading.current_thread() is threading.main_thread()  # type: ignore[assignment]
                                   and calls.append(step), real(t))[1]
        try:
            norm, _ = opt.step(grad_clip=1e-3)
        finally:
            kernels.sumsq = real
        manager.end_step()
        assert norm is not None and norm > 1e-3
    groups = sum(1 for lst in model.chunks[ChunkKind.PARAM] for c in lst if c.used)
    assert calls.count(0) == groups  # step 0's guess was wrong: its plain step measured after backward
    assert 1 not in calls and 2 not in calls, calls
    assert opt.speculation.measured_early == 2 * groups


@pytest.mark.parametrize("bad", [(2, 5), (2, 3)])  # (2, 3): a step that does not guess overflows
def test_fp16_overflow_is_rolled_back_and_skipped(bad: tuple[int, ...]) -> None:
    want_norms, want_states, _, _ = _run(False, torch.float16, 1, bad)
    got_norms, got_states, opt, _ = _run(True, torch.float16, 1, bad)
    assert [o for _, o in got_norms] == [s in bad for s in range(STEPS)]
    assert got_norms == want_norms
    for got, want in zip(got_states, want_states):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_without_clipping_or_scaling_nothing_is_copied() -> None:
    manager = ChunkManager(None, audit=True)
    model = ChunkedModel(_net(), manager, CHUNK, report_grads=True)
    opt = ChunkAdam(model, lr=1e-2, overlap=True)
    peak = []
    real = manager.reserve_transient
    manager.reserve_transient = lambda n, what: (peak.append(n), real(n, what))  # type: ignore[method-assign]
    manager.begin_step()
    opt.arm()
    model.backward(_loss(model, 0, 0))
    norm, overflow = opt.step()
    manager.end_step()
    assert peak == [] and not overflow and norm is not None and opt.speculation.stepped_early > 0


def _rss_growth_in_backward(copy_room) -> tuple[int, int, object]:
    """One step of a 21M-parameter net whose clip never fires (a guessing step): how much the process's RSS
    grew during backward (the copies are made then, and every job waited for), the copies' bytes, and the
    speculation. Chunks of 32 MiB, so each copy is a mapping of its own that RSS shows and frees."""
    from capstan.comm.health.procmem import rss_bytes

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048),
                              torch.nn.Linear(2048, 2048))
    manager = ChunkManager(None, audit=True)
    model = ChunkedModel(net, manager, 1 << 23, report_grads=True)
    opt = ChunkAdam(model, lr=1e-3, overlap=True, copy_room=copy_room)
    x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(1))
    manager.begin_step()
    opt.arm(grad_clip=1e9)
    before = rss_bytes()
    model.backward(model(x).square().mean())
    for job in opt.speculation.jobs.values():
        job.future.result()
    grown = rss_bytes() - before
    copies = sum(job.backup_bytes for job in opt.speculation.jobs.values())
    opt.step(grad_clip=1e9)
    manager.end_step()
    return grown, copies, opt.speculation


def test_a_step_whose_copies_ram_cannot_hold_measures_instead_and_takes_no_ram_for_them() -> None:
    """copy_room (the bytes RAM can still take): a guess only where the copies take at most half of it; else
    the step measures during backward and updates after it, the same step, and RSS does not grow by the
    copies (an H200's largest offload model was killed by the out-of-memory killer in its first step)."""
    grown_guess, copies, spec = _rss_growth_in_backward(lambda: 1 << 40)
    assert spec.stepped_early > 0 and spec.no_room == 0 and copies > 200 << 20
    grown_measure, none, spec = _rss_growth_in_backward(lambda: 2 * spec.copy_bytes() - 1)
    assert spec.no_room == 1 and spec.stepped_early == 0 and spec.measured_early > 0 and none == 0
    assert grown_guess - grown_measure > 0.9 * copies, (grown_guess, grown_measure, copies)
    # the same step either way (a clip that never fires: no redo), on the small net
    want_norms, want_states, _, _ = _run(False, torch.float32, 1)
    got_norms, got_states, opt, _ = _run(True, torch.float32, 1, copy_room=lambda: 0)
    assert got_norms == want_norms and opt.speculation.stepped_early == 0 and opt.speculation.no_room > 0
    assert all(torch.equal(a, b) for got, want in zip(got_states, want_states) for a, b in zip(got, want))


def test_the_copies_of_a_guess_are_kept_for_the_next_and_freed_by_a_step_that_does_not_guess() -> None:
    """Guesses that stand step after step reuse their copies (made once, counted in the cpu tier all along):
    making and freeing 12 B a parameter a step cost the stand-in's 134M offload step 2.6 s against 0.9 s.
    A step that does not guess gives their RAM back; the next guess makes them again."""
    manager = ChunkManager(None, audit=True)
    model = ChunkedModel(_net(), manager, CHUNK, report_grads=True)
    opt = ChunkAdam(model, lr=1e-2, overlap=True)
    made: list[int] = []
    real = manager.reserve_transient
    manager.reserve_transient = lambda n, what: (made.append(n), real(n, what))  # type: ignore[method-assign]
    spec = opt.speculation
    for step, clip in enumerate([1e9, 1e9, 1e9, 1e-3, 1e9, 1e9]):  # the 4th clips: the 5th does not guess
        manager.begin_step()
        opt.arm(grad_clip=clip)
        model.backward(_loss(model, step, 0))
        opt.step(grad_clip=clip)
        manager.end_step()
        held = sum(n for _, n in spec._spare.values())
        if step < 3:
            assert len(made) == len(spec._spare) and held == manager.transient > 0, step  # made at step 0 only
        if step == 4:
            assert spec._spare == {} and manager.transient == 0  # the measuring step let them go
    assert sum(made) == 2 * held  # made twice: at the first guess and at the first after the measuring step
    opt.speculation.close()
    assert manager.transient == 0


def test_overlap_needs_reported_gradients() -> None:
    with pytest.raises(ValueError, match="report_grads=True"):
        ChunkAdam(ChunkedModel(_net(), ChunkManager(None), CHUNK), overlap=True)


@pytest.mark.parametrize("dtype,accum", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_past_ram_without_clipping_each_group_steps_in_backward_and_its_gradient_never_moves(
        tmp_path, dtype: torch.dtype, accum: int) -> None:
    """A cpu budget over a disk tier: with neither clipping nor loss scaling every chunk group is updated
    as soon as its gradients are complete, in backward's thread, bit for bit as the plain step (also past
    RAM), and its gradient chunk is dropped there: the chunk system moves fewer bytes per step."""
    never = lambda step: None  # noqa: E731
    want_norms, want_states, _, want_moved = _run(False, dtype, accum, clips=never, disk_dir=tmp_path / "a")
    got_norms, got_states, opt, got_moved = _run(True, dtype, accum, clips=never, disk_dir=tmp_path / "b")
    # (the plain step without clipping takes no norm; the overlapped one reports it, from its terms)
    assert want_norms == [(None, False)] * STEPS and all(n > 0 and not o for n, o in got_norms)
    for step, (got, want) in enumerate(zip(got_states, want_states)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step} differs"
    spec = opt.speculation
    groups = sum(1 for lst in opt.model.chunks[ChunkKind.PARAM] for c in lst if c.used)
    assert spec.streaming and spec.streamed == STEPS * groups and spec.rollbacks == spec.declined == 0
    plain, fused = ([b - a for a, b in zip(m, m[1:])] for m in (want_moved, got_moved))
    # chunks really moved; the gradients' write-back and read-back are gone (measured: fp32 0.66x the bytes,
    # bf16 with accumulation 0.84x)
    assert min(plain) > 0 and max(fused) < 0.9 * min(plain), (plain, fused)


def _always(step: int) -> float:
    return 1e-3


def test_past_ram_a_step_whose_second_slots_the_disk_cannot_take_measures_instead(tmp_path, monkeypatch) -> None:
    """A guess past RAM writes its updates to second disk slots (up to once more the states' bytes): where
    the disk's free bytes cannot take them, the step measures instead (on disk its update then runs in the
    next forward), the plain step's trajectory bit for bit, and the file never grows second slots."""
    from capstan.chunkmem import DiskStore

    never = lambda step: 1e9  # noqa: E731  (a clip that never fires: every step would guess)
    want_norms, want_states, _, _ = _run(False, torch.float32, 1, clips=never, disk_dir=tmp_path / "a")
    roomy = _run(True, torch.float32, 1, clips=never, disk_dir=tmp_path / "b")[2]
    assert roomy.speculation.no_room == 0 and roomy.speculation.streamed > 0
    first_only = sum(c.nbytes for lst_of in roomy.model.chunks.values() for lst in lst_of for c in lst)
    assert roomy.model.manager._disk().nbytes() > first_only  # guessing grew second slots
    # a disk with room for the first slots only: what the file holds is taken from it
    monkeypatch.setattr(DiskStore, "free_bytes", lambda self: first_only - self.nbytes())
    got_norms, got_states, opt, _ = _run(True, torch.float32, 1, clips=never, disk_dir=tmp_path / "c")
    spec = opt.speculation
    assert spec.no_room == STEPS and spec.streamed == 0 and spec.rollbacks == 0 and spec.measured_early > 0
    assert opt.model.manager._disk().nbytes() <= first_only
    # ... and they ran on a measuring step's trace (decided where the trace is chosen), not the guessing one
    assert opt.model.manager.trace_key in ("measure", "deferred measure")
    assert got_norms == want_norms
    for step, (got, want) in enumerate(zip(got_states, want_states)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step} differs"


@pytest.mark.parametrize("dtype,clips", [(torch.float32, _alternating), (torch.float16, _alternating),
                                         (torch.float32, _always)])
def test_past_ram_with_clipping_a_wrong_guess_is_taken_back_from_the_disk(tmp_path, dtype: torch.dtype,
                                                                          clips) -> None:
    """Past RAM with clipping (or fp16's overflow check) a step guesses as in RAM, its rollback copies the
    disk slots a chunk had before the update (ChunkManager.protect): a clipped or overflowed step is taken
    back and redone, bit for bit the plain step's, with no copy in RAM. A step after a wrong guess measures
    its norm in backward instead, on a trace of its own; always clipped, the first step's guess is taken
    back to moments that had no data yet."""
    bad = (2, 5) if dtype == torch.float16 else ()
    want_norms, want_states, _, _ = _run(False, dtype, 1, bad, clips=clips, disk_dir=tmp_path / "a")
    copies = []
    real = ChunkManager.reserve_transient

    def reserve(self: ChunkManager, n: int, what: str, on_device: bool = False) -> None:
        copies.append(what)
        real(self, n, what, on_device)

    ChunkManager.reserve_transient = reserve  # type: ignore[method-assign]
    try:
        got_norms, got_states, opt, _ = _run(True, dtype, 1, bad, clips=clips, disk_dir=tmp_path / "b")
    finally:
        ChunkManager.reserve_transient = real  # type: ignore[method-assign]
    assert got_norms == want_norms
    assert [o for _, o in got_norms] == [s in bad for s in range(STEPS)]
    for step, (got, want) in enumerate(zip(got_states, want_states)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step} differs"
    spec, mgr = opt.speculation, opt.model.manager
    groups = sum(1 for lst in opt.model.chunks[ChunkKind.PARAM] for c in lst if c.used)
    wrong = [clips(s) < 1 or s in bad for s in range(STEPS)]
    guessed = [s == 0 or not wrong[s - 1] for s in range(STEPS)]
    assert spec.declined == guessed.count(False) and spec.measured_early == sum(
        not g and not b for g, b in zip(guessed, (s in bad for s in range(STEPS)))) * groups
    assert spec.rollbacks >= 1 and spec.rollbacks == sum(g and w and s not in bad for s, (g, w)
                                                         in enumerate(zip(guessed, wrong)))
    assert spec.streamed >= sum(g and s not in bad for s, g in enumerate(guessed)) * groups - 1
    assert not copies  # nothing copied in RAM to roll back to
    assert set(mgr._traces) == {None, "measure"}  # each kind of step on its own trace
    # the second slots: at most once more the chunks' bytes on disk
    total = sum(c.nbytes for lists in opt.model.chunks.values() for lst in lists for c in lst)
    assert mgr.disk.nbytes() <= 2 * total


@pytest.mark.parametrize("dtype,accum", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_past_ram_a_measuring_step_leaves_its_update_to_the_next_forward(tmp_path, monkeypatch,
                                                                         dtype: torch.dtype, accum: int) -> None:
    """On disk, where every step clips, a step that measured its norm in backward leaves each chunk group's
    update to the next forward, run just before the group's parameters are first used (adam.py, "Deferred
    update"): nobody reads the states between steps here, so every update after the second step runs in a
    forward. The norms of every step and the states at the end are the plain step's, bit for bit, on a
    trace of its own; and the step moves fewer bytes than the same measuring step updating after backward
    (its parameters read for the update and for forward at once)."""
    want_norms, want_states, _, _ = _run(False, dtype, accum, clips=_always, disk_dir=tmp_path / "a",
                                         read_states=False)
    got_norms, got_states, opt, moved = _run(True, dtype, accum, clips=_always, disk_dir=tmp_path / "b",
                                             read_states=False)
    assert got_norms == want_norms
    assert all(torch.equal(a, b) for a, b in zip(got_states[-1], want_states[-1]))
    groups = sum(1 for lst in opt.model.chunks[ChunkKind.PARAM] for c in lst if c.used)
    # step 0 guesses (wrong), steps 1.. measure and defer; steps 2.. run the one before's in forward, and
    # the last one's ran when the states were read
    assert opt.deferred_run == (STEPS - 1) * groups and not opt.pending
    assert {"measure", "deferred measure"} <= set(opt.model.manager._traces)
    from capstan.chunkmem.optim.overlap import Speculation

    real = Speculation.__post_init__

    def no_defer(self: Speculation) -> None:
        real(self)
        self.defers = False

    monkeypatch.setattr(Speculation, "__post_init__", no_defer)
    _, after_states, plain_opt, after_moved = _run(True, dtype, accum, clips=_always, disk_dir=tmp_path / "c",
                                                   read_states=False)
    assert plain_opt.deferred_run == 0
    assert all(torch.equal(a, b) for a, b in zip(after_states[-1], want_states[-1]))
    steady = moved[-2] - moved[-3], after_moved[-2] - after_moved[-3]  # a step on its own trace, not the last
    assert steady[0] < steady[1]


def test_updates_are_left_to_forward_only_with_room_and_traces_of_their_own(tmp_path) -> None:
    """A deferred update pins a chunk group beside what forward holds (overlap.defer_fits: two of the largest
    groups), and moves forward's moments, so not under a budget of one group, nor where the manager follows
    the warm-up's per-moment measurements (a RAM limit)."""
    from capstan.chunkmem import DiskStore

    def defers(budget: int, **kw: object) -> bool:
        manager = ChunkManager(budget, DiskStore(tmp_path / f"d{budget}-{len(kw)}"), **kw)
        model = ChunkedModel(_net(), manager, CHUNK, report_grads=True)
        return ChunkAdam(model, lr=1e-2, overlap=True).speculation.defers

    group = 4 * CHUNK * 4  # fp32: parameter, gradient, both moments
    assert defers(PAST_RAM_BUDGET) and defers(2 * group)
    assert not defers(2 * group - 1)
    assert not defers(PAST_RAM_BUDGET, memory_limit=1 << 30)


def test_past_ram_a_group_that_does_not_fit_beside_backward_steps_after_it(tmp_path, monkeypatch) -> None:
    """A chunk group whose chunks would not fit in the budget beside those backward has pinned is left to
    the step after backward instead of failing (here every other group, forced through `could_pin`): the
    same steps bit for bit, the model's minimum budget unchanged by streaming."""
    net = ChunkedModel(_net(), ChunkManager(None), CHUNK, report_grads=True)
    assert net.minimum_budget() == ChunkedModel(_net(), ChunkManager(None), CHUNK).minimum_budget()
    calls = []

    def could_pin(self: ChunkManager, ids: list[int]) -> bool:
        calls.append(ids)
        return len(calls) % 2 == 0

    never = lambda step: None  # noqa: E731
    want_norms, want_states, _, _ = _run(False, torch.float32, 1, clips=never, disk_dir=tmp_path / "a")
    monkeypatch.setattr(ChunkManager, "could_pin", could_pin)
    got_norms, got_states, opt, _ = _run(True, torch.float32, 1, clips=never, disk_dir=tmp_path / "b")
    for step, (got, want) in enumerate(zip(got_states, want_states)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step} differs"
    spec = opt.speculation
    groups = sum(1 for lst in opt.model.chunks[ChunkKind.PARAM] for c in lst if c.used)
    assert spec.streamed + spec.deferred == STEPS * groups and spec.deferred == (STEPS * groups + 1) // 2


def test_could_pin_counts_what_is_pinned_and_transient(tmp_path) -> None:
    from capstan.chunkmem import DiskStore

    manager = ChunkManager(5 * CHUNK * 4, DiskStore(tmp_path))  # 5 chunks of 4096 fp32 elements
    model = ChunkedModel(_net(), manager, CHUNK)
    ids = [c.chunk_id for kind in (ChunkKind.PARAM, ChunkKind.EXP_AVG) for lst in model.chunks[kind] for c in lst]
    assert len(ids) >= 6 and manager.could_pin(ids[:5]) and not manager.could_pin(ids[:6])
    manager.access(ids[0])  # pinned: four more fit beside it, not five
    assert manager.could_pin(ids[:5]) and manager.could_pin(ids[1:5]) and not manager.could_pin(ids[1:6])
    manager.reserve_transient(CHUNK * 4, "a buffer")
    assert not manager.could_pin(ids[1:5]) and manager.could_pin(ids[1:4])
