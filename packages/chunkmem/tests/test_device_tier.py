"""The device tier's mechanics (device.py, transfer.py), on a CPU stand-in device and, where there is one,
on a GPU: RAM buffers kept for chunks on the device (pinned once, not per move), prefetch to the
device from the warm-up trace, a device budget that follows the activations, and the overlapped
optimizer step with chunks coming off the device. Exactness against RAM-only training is checked in
test_training_parity.py and test_mixed_precision.py; here each mechanism is shown to act."""

from __future__ import annotations

import contextlib

import pytest
import torch

from capstan.chunkmem import BudgetError, ChunkAdam, ChunkedModel, ChunkKind, ChunkManager, DiskStore
from capstan.chunkmem.memory.transfer import STAGING_BUFFERS, staging_buffer_bytes
from capstan.comm.testing import BF16_VS_CPU, cpu_arithmetic, cuda_param
from capstan.native import standin

CHUNK = 4096
# "cpu": a device tier in RAM; "standin": an accelerator that is not the CPU (capstan.native.standin);
# "cuda" where there is a GPU
DEVICES = ["cpu", standin.param(), cuda_param()]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 32),
        torch.nn.LayerNorm(32), torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 64),
    )


def _loss(model: torch.nn.Module, step: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (4, 8), generator=g).to(device)
    return torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 64), ((x * 3 + 1) % 64).reshape(-1))


def _train(manager: ChunkManager, steps: int, device: str, overlap: bool = False, dtype=torch.bfloat16,
           each_step=None, clip: float = 1.0, opts: list | None = None) -> tuple[list[float], ChunkedModel]:
    model = ChunkedModel(_net(), manager, CHUNK, dtype=dtype, report_grads=overlap)
    opt = ChunkAdam(model, lr=1e-2, weight_decay=0.1, overlap=overlap)
    if opts is not None:
        opts.append(opt)
    losses = []
    for s in range(steps):
        manager.begin_step()
        if overlap:
            opt.arm(grad_clip=clip)
        loss = _loss(model, s, device)
        model.backward(loss)
        opt.step(grad_clip=clip)
        manager.end_step()
        losses.append(loss.item())
        if each_step is not None:
            each_step(s, manager)
    return losses, model


@pytest.mark.parametrize("device", DEVICES)
def test_ram_buffers_are_kept_for_chunks_on_the_device(device: str) -> None:
    """RAM unbounded: a chunk's RAM buffer waits for it while it is on the device, so after the
    first steps no step allocates one (pinned memory on a GPU: allocated once per chunk)."""
    manager = ChunkManager(None, audit=True, device=device, device_budget=None)
    allocs = []
    real = manager._alloc
    manager._alloc = lambda chunk: (allocs.append(chunk.kind), real(chunk))[1]  # type: ignore[method-assign]
    per_step = []
    _train(manager, 5, device, each_step=lambda s, m: per_step.append(len(allocs)))
    moved = manager.device_tier.transfers.copies
    assert moved > 5 * 4  # the optimizer takes every parameter chunk off the device, forward brings it back
    assert per_step[1] == per_step[-1], per_step  # steps 3-5 allocated nothing
    assert manager.stats()["cpu"]["resident_bytes"] == manager.cpu.resident  # kept buffers are counted


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_chunks_are_made_on_the_device_not_copied_up_as_zeros(device: str) -> None:
    """After the step a gradient chunk reads as zeros; the next backward needs it on the device, where it
    is made (zeroed there), instead of zeroing RAM and copying the zeros up every step."""
    moves: list[tuple[ChunkKind, str | None]] = []
    manager = ChunkManager(None, audit=True, device=device)
    real = manager.device_tier.to_device
    manager.device_tier.to_device = lambda entry, fresh=None: (moves.append((entry.chunk.kind, fresh)),  # type: ignore
                                                    real(entry, fresh))[1]
    want, _ = _train(ChunkManager(None, audit=True), 4, "cpu", dtype=torch.float32)
    got, _ = _train(manager, 4, device, dtype=torch.float32)
    grads = [fresh for kind, fresh in moves if kind == ChunkKind.GRAD]
    assert grads and all(fresh is not None for fresh in grads), moves  # never copied from RAM
    if device == "cuda":  # GPU kernels round differently from the CPU's: 1e-4 (TF32 off, torch's default)
        assert got == pytest.approx(want, rel=1e-4)
    else:  # the stand-in runs the CPU's own kernels
        assert got == want


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_to_the_device_skips_chunks_pinned_in_ram(device: str) -> None:
    """A chunk pinned in RAM (the overlapped optimizer's worker reads it there) stays there: the prefetch
    that would copy it up ahead of use leaves it for later."""
    manager = ChunkManager(None, audit=True, device=device, device_budget=3 * CHUNK * 4)
    _train(manager, 2, device)
    first = next(cid for cid, compute in zip(manager.trace, manager.device_tier.trace_compute, strict=True)
                 if compute)
    if manager.entries[first].where == "device":  # (the optimizer wrote it through: back to RAM for the test)
        manager.device_tier.off_device(manager.entries[first])
        manager.device_tier.land(manager.entries[first])
    assert manager.entries[first].where == "cpu"
    manager.entries[first].pins += 1
    manager.device_tier.prefetch()
    assert manager.entries[first].where == "cpu"
    manager.entries[first].pins -= 1
    manager.device_tier.prefetch()
    assert manager.entries[first].where == "device"  # unpinned, the same prefetch takes it


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_to_the_device_runs_ahead_of_use(device: str) -> None:
    want, _ = _train(ChunkManager(None, audit=True), 6, "cpu")  # the RAM-only reference, on the CPU
    manager = ChunkManager(None, audit=True, device=device, device_budget=3 * CHUNK * 4)
    got, _ = _train(manager, 6, device)
    c = manager.counters
    assert c["device_prefetches"] > 0 and c["device_prefetch_hits"] > 0, c
    if cpu_arithmetic(device):
        assert got == want  # the same arithmetic, moved around
    else:  # a GPU's bf16 kernels round in other orders: the trajectory, not the bits (testing/devices.py)
        assert got == pytest.approx(want, rel=BF16_VS_CPU), (got, want)


def test_the_device_budget_follows_the_activations() -> None:
    """A device limit with a measure: the warm-up records the non-model bytes at each moment (here a
    fake measure: chunks plus activations that grow in forward and shrink in backward), and every later
    moment gives chunks the limit minus the activations of that moment and the next."""
    acts: dict[int, int] = {}

    def activations(moment: int) -> int:
        return acts.setdefault(moment, 6 * CHUNK * (moment % 9))  # a saw-tooth over each step's accesses

    limit = 60 * CHUNK
    manager = ChunkManager(None, audit=True, device="cpu", device_budget=8 * CHUNK * 2, device_limit=limit,
                           device_measure=lambda: manager.dev.resident + activations(manager.moment))
    seen = []
    real = manager.device_tier.record

    def record(chunk_id: int, compute: bool) -> None:
        real(chunk_id, compute)
        if manager.trace is not None:
            seen.append((manager.moment, manager.dev.capacity, manager.dev.resident))

    manager.device_tier.record = record  # type: ignore[method-assign]
    _train(manager, 4, "cpu")
    nonmodel = manager.device_tier.nonmodel_device
    assert nonmodel == [activations(m) for m in range(len(nonmodel))]  # what the warm-up measured
    assert len({cap for _, cap, _ in seen}) > 3  # the capacity moved with the activations
    assert all(held <= cap for _, cap, held in seen)
    for m, cap, _ in seen:  # this moment's and the next one's activations, the step's peak beyond the trace
        ahead = max(nonmodel[m], nonmodel[m + 1]) if m + 1 < len(nonmodel) else max(nonmodel)
        assert cap == limit - ahead, (m, cap)

    small = ChunkManager(None, device="cpu", device_budget=8 * CHUNK * 2, device_limit=8 * CHUNK * 2,
                         device_measure=lambda: small.dev.resident + 20 * CHUNK)
    with pytest.raises(BudgetError, match=r"device memory limit of \d+ bytes is below what the warm-up step needed"):
        _train(small, 1, "cpu")


@pytest.mark.parametrize("clip", [1.0, 1e-3])  # 1e-3: every step clips, steps 1-4 only measure during backward
@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_step_with_chunks_on_the_device(device: str, clip: float) -> None:
    plain, m1 = _train(ChunkManager(None, audit=True, device=device), 5, device, clip=clip)
    opts: list = []
    overlapped, m2 = _train(ChunkManager(None, audit=True, device=device), 5, device, overlap=True, clip=clip,
                            opts=opts)
    assert overlapped == plain
    if clip < 1e-2:  # the norm terms were taken off chunks landing from the device, while backward ran
        assert opts[0].speculation.declined == 4 and opts[0].speculation.measured_early > 0
    masters = [[c.payload.clone() for c in lst] for m in (m1, m2) for lst in m.chunks[ChunkKind.MASTER]]
    assert all(torch.equal(a, b) for a, b in zip(masters[0], masters[1]))


def _pinned_host_bytes(device: str) -> int:
    """Pinned RAM the device runtime's caching host allocator holds (blocks in use and cached)."""
    if device == "standin":
        return standin.host_stats()["reserved"]
    stats = torch.cuda.host_memory_stats()  # the key for owned blocks changed name across torch versions
    return max(stats.get("reserved_bytes.current", 0), stats.get("allocated_bytes.current", 0))


@pytest.mark.parametrize("device", [standin.param(), cuda_param()])
def test_pinned_ram_under_a_budget_is_a_staging_pool_counted_in_the_cpu_tier(device: str, tmp_path) -> None:
    """Under a RAM budget with disk, pinned memory is what the cpu tier counts: pinning every chunk's buffer
    let the host allocator's power-of-two rounding and cached blocks hold about twice the count (1.10 MB
    pinned for 0.48 MB of chunks, measured on the stand-in). Chunk buffers stay pageable; copies go through
    STAGING_BUFFERS page-locked buffers, each the largest chunk rounded to a power of two, counted."""
    import gc

    want, _ = _train(ChunkManager(None, audit=True), 6, "cpu")
    gc.collect()
    if device == "standin":
        standin.empty_host_cache()
    else:
        torch.cuda.synchronize()
        torch._C._host_emptyCache()
    # torch's own scalar readbacks (`.item()`) on a GPU go through a tiny pinned block it keeps cached: on an
    # H200 (first lease) the run below grew pinned RAM by the pool plus 4 bytes. Make that block before the
    # baseline so what grows is ours, and allow it below a page in case torch keeps one per dtype.
    torch.ones(1, device=device).sum().item()
    before = _pinned_host_bytes(device)
    budget = 96 << 10  # a third of the model's 280 KiB of chunks: every step reads and writes the disk
    manager = ChunkManager(budget, DiskStore(tmp_path), audit=True, device=device, device_budget=3 * CHUNK * 2)
    got, model = _train(manager, 6, device)
    stats = manager.stats()
    largest = max(c.nbytes for k in (ChunkKind.PARAM, ChunkKind.GRAD) for lst in model.chunks.get(k, []) for c in lst)
    staging = STAGING_BUFFERS * staging_buffer_bytes(largest)
    assert stats[device]["staging_bytes"] == staging == manager.device_tier.staging_bytes()
    assert stats["disk"]["bytes_out"] > 0 and stats[device]["evictions"] > 0  # it streamed
    grown = _pinned_host_bytes(device) - before
    assert staging <= grown < staging + 4096, (grown, staging)  # all the pinned RAM there is, and counted
    if device == "standin":  # no torch-internal pinned blocks there: exactly the pool
        assert grown == staging
    assert stats["cpu"]["peak_bytes"] <= budget
    assert not any(e.chunk.payload.is_pinned() for e in manager.entries.values()
                   if e.where == "cpu" and e.chunk.payload is not None)
    if cpu_arithmetic(device):
        assert got == want  # the staged copies move the same bytes
    else:
        assert got == pytest.approx(want, rel=BF16_VS_CPU), (got, want)
    manager.close()

    # the staging pool is part of the minimum budget, named in the refusal
    small = ChunkManager(staging, DiskStore(tmp_path / "small"), device=device)
    with pytest.raises(BudgetError, match="pinned staging buffers"):
        ChunkedModel(_net(), small, CHUNK, dtype=torch.bfloat16)


@standin.requires()
def test_staged_copies_wait_for_copies_the_device_has_not_finished(tmp_path) -> None:
    """Under a RAM budget copies go through the staging pool, and a copy from the device lands in the
    chunk's RAM buffer only when its event is done. The stand-in's ops run at once, so its events are
    done when first asked, which hid this on the CPU: chunk X leaves the device while stage 0 is busy (its
    landing waits in stage 1), stage 0 comes free, and X goes back up from a RAM buffer no one finished
    landing -- on a GPU, stale weights. With events that answer "not done" to their first queries, as a
    GPU's copies in flight would, X must come back with the values it left with; and training equals
    the CPU bit for bit."""
    device = standin.load()
    manager = ChunkManager(96 << 10, DiskStore(tmp_path / "x"), device=device, device_budget=3 * CHUNK * 2)
    model = ChunkedModel(_net(), manager, CHUNK, dtype=torch.bfloat16)
    x, y = (c.chunk_id for c in model.chunks[ChunkKind.PARAM][0][:2])
    tier = manager.device_tier
    with standin.late_events(5):
        for cid, value in ((x, 7.0), (y, 3.0)):
            manager.access(cid, write=True, compute=True).payload.fill_(value)  # on the device now
            manager.release(cid)
        tier.off_device(manager.entries[y])  # stage 0, in flight
        tier.off_device(manager.entries[x])  # stage 0 busy: stage 1, in flight
        tier.land(manager.entries[y])  # stage 0 free again; stage 1 still holds x's landing
        back = manager.access(x, compute=True).payload
        assert bool((back.cpu() == 7.0).all()), back.cpu()[:4]
        manager.release(x)
    manager.close()

    want, _ = _train(ChunkManager(None), 6, "cpu")
    for lag in (1, 3):
        manager = ChunkManager(96 << 10, DiskStore(tmp_path / f"lag{lag}"), device=device,
                               device_budget=3 * CHUNK * 2)
        with standin.late_events(lag):
            got, _ = _train(manager, 6, device)
        assert manager.stats()["disk"]["bytes_out"] > 0 and manager.stats()[device]["evictions"] > 0
        manager.close()
        assert got == want, (lag, got, want)


@pytest.mark.parametrize("device", [standin.param(), cuda_param()])
def test_the_device_peak_reads_what_torch_reports(device: str) -> None:
    """DevicePeak reads the reserved peak from the allocator's nested statistics (torch's
    max_memory_reserved flattens every statistic in Python first): the same number, and the engine's
    per-step read and the manager's per-moment one still share the counter."""
    from capstan.chunkmem.memory.device import DevicePeak
    from capstan.comm.job.accelerator import device_module

    dev = torch.device(standin.load() if device == "standin" else device, 0)
    mod = device_module(dev)
    peak = DevicePeak(dev)
    x = torch.empty(1 << 22, device=dev)
    assert peak._reserved_peak() == mod.max_memory_reserved(dev) > 0
    moment = peak.moment()  # resets torch's counter
    del x
    mod.empty_cache()
    assert moment >= 1 << 24 and peak.step() >= moment
    small = torch.empty(1 << 10, device=dev)
    assert peak.step() < moment  # each step's own peak, not the most since the warm-up (step resets it too)
    assert peak.allocated_peak() >= 1 << 24  # what tensors held at most in the run, over the resets
    del small


def _with_ways(devices: list, ways: tuple[str, ...]) -> list:
    """(device, way) parameters of every device in `devices` (pytest params keep their marks) and way."""
    out = []
    for d in devices:
        value, marks, ident = (d.values[0], d.marks, d.id) if hasattr(d, "values") else (d, (), d)
        out += [pytest.param(value, way, marks=marks, id=f"{way}-{ident}") for way in ways]
    return out


@pytest.mark.parametrize(("device", "way"), _with_ways(DEVICES, ("plain", "overlapped"))
                         + _with_ways([standin.param()], ("late copies",)))  # (late events are the stand-in's)
@pytest.mark.parametrize("budget", [None, 4 * CHUNK * 4])
def test_updated_parameters_go_back_up_under_the_optimizer(device: str, budget: int | None, way: str) -> None:
    """After backward the optimizer updates each parameter chunk in RAM; each is copied up to the device as
    soon as its group is stepped, into room the budget leaves (write-through), so the next forward finds
    them there instead of prefetching two ahead: with room for all, every parameter chunk the trace
    computes with is on the device when the step ends; with room for four of the five, as many as fit
    and the budget holds (audited). The same losses as chunks kept in RAM, to the bit on the stand-in.
    "late copies": the copies off the device that the optimizer's reads start are not done when it asks,
    as on a GPU, where their bytes stayed counted and every write-through found no room. "overlapped": the
    groups stepped during backward (the guess held: no clipping) go up too, not only those stepped after."""
    overlap, clip = (True, None) if way == "overlapped" else (False, 1.0)
    want, _ = _train(ChunkManager(None, audit=True), 4, "cpu", dtype=torch.float32, overlap=overlap, clip=clip)
    where: list[list[str | None]] = []

    def params_at_step_end(s: int, m: ChunkManager) -> None:
        computes = {cid for cid, c in zip(m.trace, m.device_tier.trace_compute, strict=True) if c}
        where.append([m.entries[cid].where for cid in computes
                      if m.entries[cid].chunk.kind == ChunkKind.PARAM])

    manager, opts = ChunkManager(None, audit=True, device=device, device_budget=budget), []
    with standin.late_events(3) if way == "late copies" else contextlib.nullcontext():
        got, _ = _train(manager, 4, device, dtype=torch.float32, each_step=params_at_step_end,
                        overlap=overlap, clip=clip, opts=opts)
    if device == "cuda":
        assert got == pytest.approx(want, rel=1e-4)
    else:
        assert got == want
    for step in where[1:]:  # (the warm-up step has no trace yet)
        on_device = step.count("device")
        if budget is None:
            assert on_device == len(step) > 2, where  # every one, not only the prefetch's two
        else:
            assert 2 < on_device <= budget // (CHUNK * 4) < len(step), where
    assert manager.counters["device_writes_through"] > 0
    if overlap:
        assert opts[0].speculation.stepped_early > 0  # (the groups this checks were stepped during backward)


@pytest.mark.parametrize(("device", "lag"), [pytest.param(*p.values, 0, marks=p.marks, id=f"{p.id}-0")
                                             for p in (standin.param(), cuda_param())]
                         + [pytest.param(*standin.param().values, 3, marks=standin.param().marks, id="standin-3")])
def test_chunks_nothing_wrote_on_the_device_go_back_without_a_copy(device: str, lag: int) -> None:
    """fp32: forward and backward only read the parameter chunks on the device, and the CPU optimizer then
    takes each back to RAM. With RAM unbounded the buffer kept for the way back still holds what the
    device holds, so none is copied: after the warm-up, the bytes copied off the device are the gradient
    chunks' alone. The same bits as the CPU (lag: copies up not yet done when the host asks, as on a GPU).
    The lag is the stand-in's alone: a GPU's copies are late on their own, and `late_events` needs the
    stand-in loaded (the fourth lease's `pytest -m cuda` failed on a cuda-3 case)."""
    want, _ = _train(ChunkManager(None), 4, "cpu", dtype=torch.float32)
    manager = ChunkManager(None, audit=True, device=device, device_budget=None)
    stats = manager.device_tier.dev.stats
    out_per_step: list[int] = []
    with standin.late_events(lag) if lag else contextlib.nullcontext():
        got, model = _train(manager, 4, device, dtype=torch.float32,
                            each_step=lambda s, m: out_per_step.append(stats.bytes_out))
    if device == "cuda":
        assert got == pytest.approx(want, rel=1e-4)
    else:
        assert got == want
    grads = sum(c.nbytes for per_list in model.chunks[ChunkKind.GRAD] for c in per_list)
    params = [c for per_list in model.chunks[ChunkKind.PARAM] for c in per_list if c.used]
    steps = [b - a for a, b in zip(out_per_step, out_per_step[1:])]
    assert grads > 0 and all(0 < s <= grads for s in steps), (steps, grads)
    assert manager.counters["device_clean_drops"] >= 3 * len(params)


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_between_steps_leaves_the_trace_alone(device: str) -> None:
    """Saving reads every state and resuming writes them, between steps: those accesses are no moments of a
    step. After a save the next step starts at moment 0 on the same trace, and a run resumed from the
    states (written before its first step) records the warm-up trace an uninterrupted run records.
    Recorded, a resume's accesses became the head of the warm-up trace for the whole run: on a GPU every
    later moment took its device capacity and prefetch from the wrong one (the eval's old defect)."""
    from capstan.chunkmem.model.state_io import FIELDS, owned_homes, read_state, write_state

    saved: dict[tuple[str, str], torch.Tensor] = {}
    opts: list = []
    manager = ChunkManager(None, audit=True, device=device, device_budget=None)

    def save_after_step_two(s: int, m: ChunkManager) -> None:
        if s != 1:
            return
        trace, model = list(m.trace), opts[0].model
        for home in owned_homes(model):
            for field in FIELDS:
                saved[(home.name, field)] = read_state(model, home, field)
        assert m.moment == 0 and m.trace == trace

    _train(manager, 3, device, dtype=torch.float32, each_step=save_after_step_two, opts=opts)
    warmup = manager._traces[manager.trace_key][0]
    manager.close()

    resumed = ChunkManager(None, audit=True, device=device, device_budget=None)
    model = ChunkedModel(_net(), resumed, CHUNK, dtype=torch.float32)
    opt = ChunkAdam(model, lr=1e-2, weight_decay=0.1)
    for home in owned_homes(model):
        for field in FIELDS:
            write_state(model, home, field, saved[(home.name, field)])
    assert resumed.moment == 0
    resumed.begin_step()
    model.backward(_loss(model, 2, device))
    opt.step(grad_clip=1.0)
    resumed.end_step()
    assert resumed.trace == warmup and len(warmup) > 0
    resumed.close()


def test_the_chunks_ahead_are_every_moments_in_order_of_next_use() -> None:
    """The prefetch's walk over the runs of computing moments (`DeviceTier.chunks_ahead`) yields what a walk
    over every moment ahead yields, at every moment of random traces: repeats, chunks the optimizer touches
    (not computing), a limit of distinct chunks, the trace's end. The same trace twice is indexed once."""
    import random
    from types import SimpleNamespace

    from capstan.chunkmem.memory.device import DeviceTier

    def every_moment(trace: list[int], compute: list[bool], moment: int, limit: int) -> list[int]:
        out: list[int] = []
        for m in range(moment, len(trace)):
            if len(out) >= limit:
                break
            if compute[m] and trace[m] not in out:
                out.append(trace[m])
        return out

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(0, 60)
        trace = [rng.randrange(0, rng.randrange(1, 12)) for _ in range(n)]
        for k in range(1, n):  # runs of one chunk, as a module's parameters accessed in a row
            if rng.random() < 0.4:
                trace[k] = trace[k - 1]
        compute = [rng.random() < 0.7 for _ in range(n)]
        tier = object.__new__(DeviceTier)
        tier.m, tier.trace_compute, tier._ahead = SimpleNamespace(trace=trace, moment=0), compute, None
        for moment in range(n + 1):
            tier.m.moment = moment
            for limit in (1, 3, 16):
                assert list(tier.chunks_ahead(limit)) == every_moment(trace, compute, moment, limit), \
                    (trace, compute, moment, limit)
        indexed = tier._ahead
        list(tier.chunks_ahead())
        assert tier._ahead is indexed
