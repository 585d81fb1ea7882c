"""ZeRO-3 through chunks: 2 and 4 data-parallel ranks train like one process.

Each rank gets its slice of the same global batch; gradients are averaged
over the group, so the mean of the ranks' losses is the single-process loss
(fp32; differences come from summation order: 1e-6 relative).

The sharded minimum budget is enough for modules whose parameters sit in
two parameter groups: a Linear's weight goes to the decay group and its bias
(and every LayerNorm parameter) to the no-decay group, so one module's
access gathers a unit of each group and its backward fills a gradient buffer
of each. Two ranks with exactly the minimum budget (chunks spill to
disk) train like one process with torch.optim.AdamW over the same two
groups; one byte less is refused when the model is built, on every rank
(the budget checked is the largest minimum over the group). (The minimum is
safe, not tight: these models would still run one chunk below it;
docs/chunkmem.md.) Tied and frozen parameters, which stay pinned through
backward, are counted too.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from capstan.comm.testing import run_ranks

CHUNK = 4096
STEPS = 8


def _model(hidden: int = 96) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Embedding(64, 32)]
    for _ in range(3):
        layers += [torch.nn.Linear(32, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 32), torch.nn.LayerNorm(32)]
    layers.append(torch.nn.Linear(32, 64))
    return torch.nn.Sequential(*layers)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 64, (4, 8), generator=g)
    return x, (x * 3 + 1) % 64


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1))


def _reference(model: torch.nn.Module | None = None, opt: torch.optim.Optimizer | None = None,
               steps: int = STEPS) -> list[float]:
    """One process, torch.optim.AdamW (one group with decay unless given), clipping at 1.0."""
    model = model or _model()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for s in range(steps):
        loss = _loss(model, *_data(s))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _sharded(memory_saving: bool, budget: int | None, device: str | None = None,
             device_budget: int | None = None) -> dict[str, object]:
    from capstan import comm
    from capstan.chunkmem import ChunkAdam, ChunkManager, DiskStore, ShardedChunkedModel

    groups = comm.build_groups(comm.Topology(dp=comm.world().size))
    dp = groups.dp
    with tempfile.TemporaryDirectory() as tmp:
        manager = ChunkManager(budget, DiskStore(tmp, rank=dp.rank), audit=True, device=device,
                               device_budget=device_budget)
        model = ShardedChunkedModel(_model(), manager, CHUNK, group=dp, memory_saving=memory_saving)
        opt = ChunkAdam(model, lr=1e-2, weight_decay=0.1)
        losses = _train(model, manager, opt, dp, STEPS)
        owned = sum(len(model.owned_indices(g)) for g in range(len(model.chunks[model_kind()])))
        stats = manager.stats()
        gathers = model.unit_gathers  # before state_tensors(), which gathers every unit once more
        final = {k: v.sum().item() for k, v in model.state_tensors().items()}
        manager.close()
    units = sum(-(-len(lst) // (1 if memory_saving else dp.size)) for lst in model.chunks[model_kind()])
    return {"losses": losses, "owned": owned, "peak": stats["cpu"]["peak_bytes"], "final": final,
            "gathers_per_step": gathers / STEPS, "units": units, "device": stats.get("device")}


def _train(model, manager, opt, dp, steps: int) -> list[float]:  # noqa: ANN001 - chunkmem types, imported late
    """`steps` steps on this rank's rows of each global batch; the global mean loss of each."""
    from capstan import comm

    losses = []
    for s in range(steps):
        x, y = _data(s)
        rows = slice(dp.rank * 4 // dp.size, (dp.rank + 1) * 4 // dp.size)
        manager.begin_step()
        loss = _loss(model, x[rows], y[rows])
        model.backward(loss)
        opt.step(grad_clip=1.0)
        manager.end_step()
        t = torch.tensor([loss.item()])
        comm.all_reduce(t, op="avg", group=dp)
        losses.append(t.item())
    return losses


def model_kind():  # noqa: ANN201 - tiny indirection so the child need not import at module level
    from capstan.chunkmem import ChunkKind

    return ChunkKind.PARAM


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_two_and_four_ranks_sharded_match_one_process() -> None:
    want = _reference()
    for n in (2, 4):
        results = run_ranks(_sharded, n, False, None, timeout=240)
        for r in results:
            assert _rel(r["losses"], want) <= 1e-6, (n, r["losses"], want)
        # Every rank owns 1/n of the (padded) chunk list; the parameters end identical everywhere.
        assert len({r["owned"] for r in results}) == 1
        assert all(r["final"] == results[0]["final"] for r in results)
        # Unbounded RAM: a gathered unit stays until the end of backward, so each is gathered once a step.
        assert results[0]["gathers_per_step"] == results[0]["units"], results[0]
    assert want[-1] < want[0]


def test_units_stay_gathered_in_what_the_budget_leaves_above_the_minimum() -> None:
    # 40 chunks: the owned states of a rank (6 x 4 kinds) and every unit fit with room to spare, so
    # no unit is dropped before the end of backward: one all-gather per unit per step, as unbounded.
    budget = 40 * CHUNK * 4
    want = _reference()
    for r in run_ranks(_sharded, 2, False, budget, timeout=240):
        assert _rel(r["losses"], want) <= 1e-6
        assert r["gathers_per_step"] == r["units"] and r["peak"] <= budget, r


def test_memory_saving_mode_equals_normal_mode_under_a_disk_budget() -> None:
    budget = 8 * CHUNK * 4  # owned chunks (6 per rank x 4 kinds) spill to disk every step; too
    # little left above the minimum to keep every gathered unit (one of them is re-gathered)
    normal = run_ranks(_sharded, 2, False, budget, timeout=240)
    saving = run_ranks(_sharded, 2, True, budget, timeout=240)
    assert _rel(saving[0]["losses"], normal[0]["losses"]) <= 1e-6
    assert all(r["peak"] <= budget for r in normal + saving)
    # Under a budget a unit leaves once nothing pins it: gathered again in backward, and per module.
    assert all(r["gathers_per_step"] > r["units"] for r in normal + saving)
    # Only one remote chunk at a time: the memory-saving peak is no higher than the normal one.
    assert max(r["peak"] for r in saving) <= max(r["peak"] for r in normal)


def _sharded_on_devices() -> dict[str, object]:
    """ZeRO-3 chunks with a device tier (a CPU stand-in: separately counted buffers in RAM): gathered
    units, gradient buffers and reductions in the device tier, whose budget holds them; unbounded
    and under a budget that moves chunks (and a RAM budget with disk below)."""
    return {"plain": _sharded(False, 8 * CHUNK * 4),
            "device": _sharded(False, 8 * CHUNK * 4, device="cpu"),
            "device-budget": _sharded(False, 8 * CHUNK * 4, device="cpu", device_budget=10 * CHUNK * 4),
            "saving-device-budget": _sharded(True, 8 * CHUNK * 4, device="cpu", device_budget=6 * CHUNK * 4)}


def test_sharded_chunks_through_a_device_tier_train_exactly_as_in_ram() -> None:
    for r in run_ranks(_sharded_on_devices, 2, timeout=240):
        plain = r["plain"]
        for name in ("device", "device-budget", "saving-device-budget"):
            got = r[name]
            assert got["losses"] == plain["losses"] and got["final"] == plain["final"], name
            assert got["device"]["bytes_in"] > 0, got["device"]  # parameter chunks really computed there
        assert r["device-budget"]["device"]["peak_bytes"] <= 10 * CHUNK * 4
        assert r["saving-device-budget"]["device"]["peak_bytes"] <= 6 * CHUNK * 4


BUDGET_CHUNK = 2048
BUDGET_STEPS = 6


def _groups(model: torch.nn.Module) -> list[list[str]]:
    decay = [n for n, p in model.named_parameters() if p.dim() == 2]
    return [decay, [n for n, p in model.named_parameters() if p.dim() < 2]]


def _group_max(need: int, dp) -> int:  # noqa: ANN001 - a comm.Group
    """The budget every rank needs: the largest minimum over the group (ranks own different chunks)."""
    from capstan import comm

    t = torch.tensor([float(need)], dtype=torch.float64)
    comm.all_reduce(t, op="max", group=dp)
    return int(t.item())


def _two_group_reference() -> list[float]:
    model = _model(48)
    named = dict(model.named_parameters())
    decay, no_decay = _groups(model)
    opt = torch.optim.AdamW([{"params": [named[n] for n in decay], "weight_decay": 0.1},
                             {"params": [named[n] for n in no_decay], "weight_decay": 0.0}], lr=1e-2)
    return _reference(model, opt, BUDGET_STEPS)


def _sharded_at_minimum(memory_saving: bool) -> dict[str, object]:
    from capstan import comm
    from capstan.chunkmem import AdamGroup, BudgetError, ChunkAdam, ChunkManager, DiskStore, ShardedChunkedModel

    torch.set_num_threads(1)
    dp = comm.build_groups(comm.Topology(dp=comm.world().size)).dp
    net = _model(48)
    groups = _groups(net)
    probe = ShardedChunkedModel(net, ChunkManager(None), BUDGET_CHUNK, group=dp, memory_saving=memory_saving,
                                param_groups=groups)
    need = _group_max(probe.minimum_budget()[0], dp)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ShardedChunkedModel(_model(48), ChunkManager(need - 1, DiskStore(tmp, rank=dp.rank)), BUDGET_CHUNK,
                                group=dp, memory_saving=memory_saving, param_groups=groups)
            refused = False
        except BudgetError as exc:  # the bound is safe, not tight: the message says so
            refused = "worst case" in str(exc)
    with tempfile.TemporaryDirectory() as tmp:
        manager = ChunkManager(need, DiskStore(tmp, rank=dp.rank), audit=True)
        model = ShardedChunkedModel(_model(48), manager, BUDGET_CHUNK, group=dp, memory_saving=memory_saving,
                                    param_groups=groups)
        opt = ChunkAdam(model, [AdamGroup(lr=1e-2, weight_decay=0.1), AdamGroup(lr=1e-2, weight_decay=0.0)])
        losses = _train(model, manager, opt, dp, BUDGET_STEPS)
        stats = manager.stats()
        manager.close()
    return {"losses": losses, "need": need, "refused": refused, "peak": stats["cpu"]["peak_bytes"],
            "writes": stats["writes"]}


@pytest.mark.parametrize("memory_saving", [False, True])
def test_two_group_modules_train_within_the_minimum_budget(memory_saving: bool) -> None:
    want = _two_group_reference()
    for r in run_ranks(_sharded_at_minimum, 2, memory_saving, timeout=240):
        assert r["refused"], "a budget one byte below the minimum must be refused up front"
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], want)) <= 1e-6, (r["losses"], want)
        assert r["peak"] <= r["need"]
        assert r["writes"] > 0  # the budget is tight: chunks really went to disk
    assert want[-1] < want[0]


class _TiedFrozen(torch.nn.Module):
    """Tied input/output embedding (pinned from the head's backward to the embedding's) and a frozen
    positional table (pinned from its backward to the end): both units stay gathered meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = torch.nn.Embedding(64, 32)
        self.wpe = torch.nn.Embedding(8, 32)
        self.wpe.weight.requires_grad_(False)
        self.body = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 48),
                                                              torch.nn.GELU(), torch.nn.Linear(48, 32))
                                          for _ in range(3)])
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.wte(x) + self.wpe(torch.arange(x.shape[1]))))


def _tied_frozen(memory_saving: bool) -> tuple[int, int]:
    from capstan import comm
    from capstan.chunkmem import AdamGroup, ChunkAdam, ChunkManager, DiskStore, ShardedChunkedModel

    torch.set_num_threads(1)
    dp = comm.build_groups(comm.Topology(dp=comm.world().size)).dp
    groups = _groups(_TiedFrozen())
    need = _group_max(ShardedChunkedModel(_TiedFrozen(), ChunkManager(None), BUDGET_CHUNK, group=dp,
                                          memory_saving=memory_saving, param_groups=groups).minimum_budget()[0], dp)
    with tempfile.TemporaryDirectory() as tmp:
        manager = ChunkManager(need, DiskStore(tmp, rank=dp.rank), audit=True)
        model = ShardedChunkedModel(_TiedFrozen(), manager, BUDGET_CHUNK, group=dp, memory_saving=memory_saving,
                                    param_groups=groups)
        opt = ChunkAdam(model, [AdamGroup(lr=1e-2, weight_decay=0.1), AdamGroup(lr=1e-2)])
        for s in range(3):
            manager.begin_step()
            model.backward(_loss(model, *_data(s)))
            opt.step()
            manager.end_step()
        peak = manager.stats()["cpu"]["peak_bytes"]
        manager.close()
    return need, peak


@pytest.mark.parametrize("memory_saving", [False, True])
def test_tied_and_frozen_parameters_fit_the_minimum_budget(memory_saving: bool) -> None:
    for need, peak in run_ranks(_tied_frozen, 2, memory_saving, timeout=240):
        assert peak <= need


class _WithUnused(torch.nn.Module):
    """A model with a layer forward never calls, so the unit holding it never completes in backward.

    one_unit: the whole model is one unit, whose gradient buffer then stays open across micro-batches
    (no other buffer opens and flushes it) and takes a second gradient for the same slots. Otherwise
    (`_model()`'s many units) the buffer is flushed with the spare's slots never written: they must
    reach the owners as zeros, not as whatever a reused buffer held.
    """

    def __init__(self, one_unit: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        width = 16 if one_unit else 32
        self.body = (torch.nn.Sequential(torch.nn.Embedding(64, width), torch.nn.Linear(width, 64)) if one_unit
                     else _model())
        self.spare = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _micro(step: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _data(step) if half == 0 else _data(1000 + step)


def _accumulated_reference(steps: int, one_unit: bool) -> list[float]:
    model = _WithUnused(one_unit)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for s in range(steps):
        total = 0.0
        for half in (0, 1):
            loss = _loss(model, *_micro(s, half)) / 2
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append(total)
    return out


def _sharded_accumulated(steps: int, one_unit: bool) -> list[float]:
    from capstan import comm
    from capstan.chunkmem import ChunkAdam, ChunkManager, ShardedChunkedModel

    torch.set_num_threads(1)
    dp = comm.build_groups(comm.Topology(dp=comm.world().size)).dp
    manager = ChunkManager(None, audit=True)
    model = ShardedChunkedModel(_WithUnused(one_unit), manager, CHUNK, group=dp)
    opt = ChunkAdam(model, lr=1e-2, weight_decay=0.1)
    rows = slice(dp.rank * 4 // dp.size, (dp.rank + 1) * 4 // dp.size)
    out = []
    for s in range(steps):
        manager.begin_step()
        total = torch.zeros(1)
        with model.saved_tensors():  # two backwards, then one finish_backward (as a pipeline drives it)
            for half in (0, 1):
                x, y = _micro(s, half)
                loss = _loss(model.module, x[rows], y[rows]) / 2
                loss.backward()
                total += loss.detach()
        model.finish_backward()
        opt.step(grad_clip=1.0)
        manager.end_step()
        comm.all_reduce(total, op="avg", group=dp)
        out.append(total.item())
    manager.close()
    return out


@pytest.mark.parametrize("one_unit", [True, False])
def test_gradient_buffers_add_up_across_micro_batches_and_zero_unwritten_slots(one_unit: bool) -> None:
    want = _accumulated_reference(5, one_unit)
    for got in run_ranks(_sharded_accumulated, 2, 5, one_unit, timeout=240):
        assert _rel(got, want) <= 1e-6, (got, want)
    assert want[-1] < want[0]


def _one_small_group() -> dict[str, float]:
    from capstan import comm
    from capstan.chunkmem import ChunkAdam, ChunkManager, ShardedChunkedModel

    torch.set_num_threads(1)
    dp = comm.build_groups(comm.Topology(dp=comm.world().size)).dp
    manager = ChunkManager(None, audit=True)
    model = ShardedChunkedModel(_model(hidden=8), manager, 2 * CHUNK, group=dp)
    opt = ChunkAdam(model, lr=1e-2, weight_decay=0.1)
    before = model.collective_elements
    losses = _train(model, manager, opt, dp, 3)
    numel = sum(p.numel() for p in _model(hidden=8).parameters())
    manager.close()
    return {"per_step": (model.collective_elements - before) / 3, "numel": numel, "losses": losses,
            "chunks": len(model.chunks[model_kind()][0])}


def test_collectives_move_the_used_part_of_a_unit_not_its_padding() -> None:
    # The whole model (6,008 parameters) fills part of one 8,192-element chunk, padded with a
    # second (empty) chunk for the other rank: a step gathers 6,008 elements from each rank and
    # reduces a buffer of 2 x 6,008, where whole chunks would be 8,192 and 16,384.
    want = _reference(_model(hidden=8), steps=3)
    for r in run_ranks(_one_small_group, 2, timeout=240):
        assert r["chunks"] == 2 and r["numel"] == 6008
        assert r["per_step"] == 3 * r["numel"], r
        assert _rel(r["losses"], want) <= 1e-6
