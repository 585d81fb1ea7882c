"""Partitioning without processes: every method, lazy per-stage building, summaries, errors."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from capstan.pipeline import LayerSpec, PartitionError, balanced_bounds, build_layers, layer_flops, partition
from capstan.pipeline.testing_models import Block, Embedding, Head, gpt_specs

BUILT: list[str] = []


class Counted(nn.Module):
    """A layer recording when it is really built (not on the meta device)."""

    def __init__(self, name: str, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))
        if not self.w.is_meta:
            BUILT.append(name)


def _counted(sizes: list[int]) -> list[LayerSpec]:
    return [LayerSpec(partial(Counted, f"l{i}", n), f"l{i}") for i, n in enumerate(sizes)]


def test_parameter_counts_need_no_allocation_and_building_is_per_stage() -> None:
    BUILT.clear()
    specs = _counted([10, 20, 30, 40])
    plan = partition(specs, 2, "parameters")
    assert [s.num_parameters for s in specs] == [10, 20, 30, 40]
    assert BUILT == []  # counting and planning built everything on the meta device only
    stage1 = plan.build(1, seed=0)
    assert BUILT == [f"l{i}" for i in plan.layers(1)]
    assert [name for name, _ in stage1.named_children()] == [str(i) for i in plan.layers(1)]


def test_methods() -> None:
    specs = _counted([100, 1, 1, 1, 1, 100, 1, 1])
    assert partition(specs, 3, "uniform").bounds == (0, 3, 6, 8)
    # Min-max over contiguous parts: the two 100s apart, 103 each (brute force: none is lower).
    plan = partition(specs, 2, "parameters")
    assert plan.bounds == (0, 4, 8) and [plan.parameters(p) for p in range(2)] == [103, 103]
    sizes = [100, 1, 1, 1, 1, 100, 1, 1]
    best = min(max(sum(sizes[:c]), sum(sizes[c:])) for c in range(1, len(sizes)))
    assert best == 103
    assert partition(specs, 4, [0, 1, 5, 6, 8]).bounds == (0, 1, 5, 6, 8)

    gpt = gpt_specs(vocab=50, hidden=16, layers=5, heads=2, seq=4)
    typed = partition(gpt, 2, "type:^Block$")
    counts = [sum(gpt[i].type_name == "Block" for i in typed.layers(p)) for p in range(2)]
    assert counts == [3, 2] and typed.bounds == (
        0,
        4,
        7,
    )  # the embedding rides with the first blocks
    assert [s.type_name for s in gpt] == ["Embedding"] + ["Block"] * 5 + ["Head"]


def test_summary_lists_layers_and_parameters() -> None:
    text = partition(_counted([10, 20, 30, 40]), 2, "parameters").summary()
    assert text.splitlines() == [
        "partition (parameters) of 4 layers into 2 parts:",
        "  part 0: layers 0..2 (3xCounted): 60 parameters (60.0%)",
        "  part 1: layers 3..3 (1xCounted): 40 parameters (40.0%)",
    ]


def test_interleaved_parts_and_tied_owners() -> None:
    specs = gpt_specs(vocab=50, hidden=16, layers=6, heads=2, seq=4, tied=True)
    plan = partition(specs, 4, "uniform")
    assert plan.stage_parts(0, 2) == [0, 2] and plan.stage_parts(1, 2) == [1, 3]
    assert plan.tied_parts() == {"embed": [0, 3]}


def test_seeded_layers_are_the_same_whoever_builds_them() -> None:
    specs = gpt_specs(vocab=50, hidden=16, layers=3, heads=2, seq=4)
    whole = build_layers(specs, range(5), seed=3)
    alone = build_layers(specs, [2], seed=3)[0]
    for a, b in zip(whole[2].parameters(), alone.parameters(), strict=True):
        assert torch.equal(a, b)
    assert (
        isinstance(whole[0], Embedding)
        and isinstance(whole[2], Block)
        and isinstance(whole[4], Head)
    )


def test_errors_name_the_problem() -> None:
    specs = _counted([1, 2, 3])
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4"):
        partition(specs, 4, "uniform")
    with pytest.raises(PartitionError, match="explicit boundaries"):
        partition(specs, 2, [0, 2, 2])
    with pytest.raises(PartitionError, match="'type:Block' matches 0 layers.*Counted"):
        partition(specs, 2, "type:Block")
    with pytest.raises(PartitionError, match="unknown partition method 'params'"):
        partition(specs, 2, "params")


def test_flops_balances_compute_not_parameters() -> None:
    """An LM: the embedding holds parameters and computes nothing, the head both. "flops" counts on meta
    (nothing built), the counts are the matmuls' (2 x m x n x k) plus attention, and the split is the
    best by compute; the same counts come from real, already-built modules."""
    vocab, hidden, seq, batch = 4096, 64, 32, 2
    specs = gpt_specs(vocab=vocab, hidden=hidden, layers=6, heads=4, seq=seq)
    x = torch.zeros(batch, seq, dtype=torch.long)
    BUILT.clear()
    flops = layer_flops(specs, x)
    tokens = batch * seq
    block = tokens * (24 * hidden * hidden + 4 * seq * hidden)  # qkv, out, 4x MLP; QK^T and AV
    assert flops[0] == 0 and flops[1:7] == [block] * 6 and flops[7] == 2 * tokens * hidden * vocab
    by_flops = partition(specs, 2, "flops", example=x)
    by_params = partition(specs, 2, "parameters")
    def worst(plan) -> int:
        return max(sum(flops[plan.bounds[k]:plan.bounds[k + 1]]) for k in range(2))
    assert by_flops.bounds != by_params.bounds and worst(by_flops) < worst(by_params)
    assert worst(by_flops) == min(max(sum(flops[:b]), sum(flops[b:])) for b in range(1, 8))
    built = [LayerSpec(lambda m=m: m) for m in build_layers(specs, range(len(specs)), seed=0)]
    assert layer_flops(built, x) == flops
    with pytest.raises(PartitionError, match="needs `example`"):
        partition(specs, 2, "flops")
    assert balanced_bounds([5, 1, 1, 1, 1, 1], 2) == (0, 1, 6)
