"""Topology math without processes: bijection, partitions, tp fastest, errors."""

from __future__ import annotations

import pytest

# A bare GPU machine may lack hypothesis (tools/gpu/battery.sh): skip this module there
# rather than fail its collection; the hatch environment always has it.
hypothesis = pytest.importorskip("hypothesis", reason="needs hypothesis (pip install hypothesis)")
given, settings, st = hypothesis.given, hypothesis.settings, hypothesis.strategies

from capstan.comm import AXES, Coord, Topology, TopologyError  # noqa: E402 (after the importorskip)

sizes = st.integers(min_value=1, max_value=6)


cps = st.integers(min_value=1, max_value=3)


@settings(deadline=None)
@given(dp=sizes, pp=sizes, tp=sizes, cp=cps)
def test_coordinates_are_a_bijection(dp: int, pp: int, tp: int, cp: int) -> None:
    topo = Topology(dp=dp, pp=pp, tp=tp, cp=cp)
    coords = [topo.coord_of(r) for r in range(topo.world_size)]
    assert len(set(coords)) == topo.world_size
    assert all(topo.rank_of(c) == r for r, c in enumerate(coords))


@settings(deadline=None)
@given(dp=sizes, pp=sizes, tp=sizes, cp=cps)
def test_each_axis_partitions_the_world(dp: int, pp: int, tp: int, cp: int) -> None:
    topo = Topology(dp=dp, pp=pp, tp=tp, cp=cp)
    for axis in AXES:
        groups = topo.groups(axis)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(topo.world_size))
        assert all(len(g) == topo.size(axis) for g in groups)
        assert len(groups) == topo.world_size // topo.size(axis)
        for g in groups:
            # Members differ only along `axis`, and are ordered by that coordinate.
            cs = [topo.coord_of(r) for r in g]
            assert [getattr(c, axis) for c in cs] == list(range(len(g)))
            for other in AXES:
                if other != axis:
                    assert len({getattr(c, other) for c in cs}) == 1
            assert all(topo.group_of(r, axis) == g for r in g)


@settings(deadline=None)
@given(dp=sizes, pp=sizes, tp=sizes, cp=cps)
def test_tp_varies_fastest_then_cp_then_dp_then_pp(dp: int, pp: int, tp: int, cp: int) -> None:
    topo = Topology(dp=dp, pp=pp, tp=tp, cp=cp)
    for r in range(topo.world_size):
        c = topo.coord_of(r)
        assert r == ((c.pp * dp + c.dp) * cp + c.cp) * tp + c.tp
    for g in topo.groups("tp"):
        assert g == list(range(g[0], g[0] + tp))  # consecutive ranks: one node
    for g in topo.groups("cp"):
        assert g == list(range(g[0], g[0] + cp * tp, tp))  # next to the tp group: one node where it can


@settings(deadline=None)
@given(dp=sizes, pp=sizes, tp=sizes, cp=cps)
def test_replica_groups_are_the_ranks_holding_the_same_parameters(dp: int, pp: int, tp: int, cp: int) -> None:
    topo = Topology(dp=dp, pp=pp, tp=tp, cp=cp)
    groups = topo.replica_groups()
    assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
    for g in groups:
        cs = [topo.coord_of(r) for r in g]
        assert len(g) == dp * cp and len({(c.pp, c.tp) for c in cs}) == 1
    if cp == 1:
        assert groups == topo.groups("dp")


def test_megatron_example_layout() -> None:
    topo = Topology(dp=2, pp=2, tp=2)
    assert topo.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.coord_of(5) == Coord(dp=0, pp=1, tp=1)
    ctx = Topology(dp=2, tp=2, cp=2)  # tp fastest, then cp: ranks 0, 2 split one sequence
    assert ctx.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]] and ctx.groups("dp")[0] == [0, 4]
    assert str(ctx) == "Topology(dp=2, pp=1, cp=2, tp=2)"


def test_world_mismatch_names_the_numbers_and_their_source() -> None:
    with pytest.raises(TopologyError, match=r"2\*2\*2 = 8 but the world size is 6 \(from world size 6 from OMPI"):
        Topology(dp=2, pp=2, tp=2).check_world(6, "world size 6 from OMPI_COMM_WORLD_SIZE")


def test_tp_group_spanning_nodes_is_detected() -> None:
    assert not Topology(dp=2, tp=4).tp_spans_nodes(local_world_size=4)
    assert Topology(dp=2, tp=4).tp_spans_nodes(local_world_size=2)
    assert Topology(pp=3, tp=2).tp_spans_nodes(local_world_size=3)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_sizes_are_rejected(bad: object) -> None:
    with pytest.raises(TopologyError, match="dp must be a positive integer"):
        Topology(dp=bad)  # type: ignore[arg-type]


def test_out_of_range_rank_and_axis() -> None:
    topo = Topology(dp=2)
    with pytest.raises(TopologyError, match="rank 2 outside 0..1"):
        topo.coord_of(2)
    with pytest.raises(TopologyError, match="unknown axis 'ep'"):
        topo.groups("ep")
