"""Partitioning without processes: every method, lazy per-stage building, summaries, errors."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from capstan.pipeline import LayerSpec, PartitionError, build_layers, partition
from capstan.pipeline.testing_models import Block, Embedding, Head, gpt_specs
from torch import nn

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
