"""A total memory limit: chunks get what the activations measured in warm-up leave at each moment.

A stack of wide linear layers on a large batch: its activations (tens of MB)
dwarf nothing at the start of forward and most of RAM at the end of it. With
`memory_limit`, the chunks may fill the room the activations leave: more than
the conservative warm-up budget early in forward and in the optimizer step,
less at the activation peak (evicting to disk), and the training is the same
as with everything in RAM.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from capstan.chunkmem import BudgetError, ChunkAdam, ChunkedModel, ChunkManager, DiskStore
from capstan.chunkmem.memory.nonmodel import check_memory_limit, nonmodel_ahead

WIDTH, LAYERS, BATCH = 512, 6, 2048
CHUNK = WIDTH * WIDTH + WIDTH  # one layer per chunk: 1 MiB of fp32
MIB = 1 << 20


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def _train(manager: ChunkManager, steps: int) -> tuple[list[float], list[list[int]]]:
    model = ChunkedModel(_net(), manager, chunk_size=CHUNK)
    opt = ChunkAdam(model, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, WIDTH, generator=g)
    losses, timelines = [], []
    for _ in range(steps):
        manager.begin_step()
        loss = ((model(x) - y) ** 2).mean()
        model.backward(loss)
        opt.step()
        timelines.append(list(manager.cpu.stats.timeline))
        manager.end_step()
        losses.append(loss.item())
    return losses, timelines


def test_chunks_fill_what_the_activations_leave(tmp_path) -> None:
    warmup_budget = 8 * MIB
    # What this process measures for the activations: the first run also pays one-time costs
    # (lazily loaded kernels count in RSS), so measure on a second run.
    for attempt in range(2):
        probe = ChunkManager(warmup_budget, DiskStore(tmp_path / f"probe{attempt}"), memory_limit=1 << 30)
        _train(probe, 1)
        probe.close()
    limit = max(probe.nonmodel) + 16 * MIB  # at the peak, less room than the 24 MiB of model states
    manager = ChunkManager(warmup_budget, DiskStore(tmp_path), audit=True, memory_limit=limit)
    got, timelines = _train(manager, 4)
    want, _ = _train(ChunkManager(None), 4)  # after: its freed memory must not hide the activations
    assert got == want  # the same arithmetic, wherever the chunks were
    nonmodel = manager.nonmodel
    assert max(nonmodel) > 25 * MIB  # the activations are real and were measured
    steady = timelines[-1]
    for m, resident in enumerate(steady):
        assert resident <= limit - nonmodel_ahead(nonmodel, m), m
    assert max(steady) > warmup_budget  # more room than the warm-up budget where activations are small
    caps = [limit - nonmodel_ahead(nonmodel, m) for m in range(len(steady))]
    assert min(caps) < 24 * MIB < max(caps)  # 24 MiB of model states: they do not fit at the peak
    assert manager.stats()["disk"]["bytes_out"] > 0
    # Chunks left RAM as activations grew, and came back: at least four of them. How many more depends on
    # how the machine's allocator returns freed activations (the last CI machine: 7 chunks, this one: 15).
    assert min(steady) <= max(steady) - 4 * CHUNK * 4  # four chunks of fp32
    manager.close()


def test_a_limit_below_chunks_plus_activations_is_refused_after_warmup(tmp_path) -> None:
    manager = ChunkManager(8 * MIB, DiskStore(tmp_path), memory_limit=10 * MIB)
    with pytest.raises(BudgetError, match=r"memory limit of 10485760 bytes is below what the warm-up step needed "
                                          r"at its busiest moment .* the minimum limit is \d+ bytes"):
        _train(manager, 1)
    manager.close()


def test_check_memory_limit_names_the_busiest_moment() -> None:
    check_memory_limit(100, [10, 20, 30], [5, 50, 60])  # 30 + 60 = 90 at moment 2
    with pytest.raises(BudgetError, match=r"busiest moment \(1\): 20 bytes of chunks in use plus 60 bytes"):
        check_memory_limit(79, [10, 20, 10], [5, 50, 60])
    assert nonmodel_ahead([5, 50, 60], 0) == 50 and nonmodel_ahead([5, 50, 60], 7) == 60


def test_memory_limit_needs_a_smaller_warmup_budget() -> None:
    with pytest.raises(ValueError, match="needs a cpu budget for the warm-up step"):
        ChunkManager(None, memory_limit=MIB)
