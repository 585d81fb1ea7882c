"""Layer costs of shapes the calibration never profiled, fitted to the shapes it did (plan/fit.py).

The planner issue's finding: calibration profiled exactly the layers it then validated, and any other
shape fell back to FLOPs at the matmul rate, 22% fast for a 6 x 320 model calibrated on 3 x 192. These
tests hold the fit to a known law exactly, and, on this machine's real layers, a tiny held-out model to
30% of its measured forward and backward (the suite's loose regression bound; docs/plan.md has the
validation table of whole steps)."""

from __future__ import annotations

import pytest
import torch

from capstan.engine.plan.costs import KINDS, layer_costs, layer_key, measure_layers
from capstan.engine.plan.fit import fitted_cost, parse_key, work_terms
from capstan.engine.plan.rates import LayerCost, Rates
from capstan.engine.plan.spec import Layout, ModelShape


def _shape(hidden: int, heads: int, seq: int, layers: int = 2) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, vocab=256, seq=seq)


def test_profile_names_read_back() -> None:
    lay = Layout(micro=2, tp=2, precision="bf16", sequence_parallel=True, cp=2, mlp_tile=64)
    k = parse_key(layer_key("block", _shape(320, 5, 96), lay, threads=3, busy=2))
    assert (k.kind, k.hidden, k.heads, k.vocab, k.seq, k.micro, k.tp) == ("block", 320, 5, 256, 96, 2, 2)
    assert k.family == ("block", "bf16", 4, 3, 2, ("sp",), "cp2u", 64)
    assert parse_key("block.h1.unknown") is None


def test_a_cost_that_follows_the_work_terms_is_fitted_exactly_for_a_held_out_shape() -> None:
    """Profiles made from a known cost per unit of work (matmul FLOPs, element-wise values, scores; logits)
    give back that law for a shape and tp none of them had."""
    lay = Layout(micro=2)
    law = {"block": (2e-11, 3e-9, 5e-9), "head": (1e-11, 4e-9), "embed": (2e-9,), "norm": (1e-9,)}

    def cost(kind: str, shape: ModelShape, layout: Layout) -> LayerCost:
        terms = work_terms(kind, shape.hidden, shape.heads, shape.vocab, shape.seq, layout.micro, 4, layout.tp, 1)
        t = sum(c * x for c, x in zip(law[kind], terms))
        return LayerCost(t, 2 * t)

    profiles = {layer_key(k, s, lay, 1): cost(k, s, lay) for s in (_shape(192, 4, 96), _shape(256, 8, 64),
                                                                   _shape(128, 4, 192), _shape(320, 8, 128))
                for k in KINDS}
    held, held_lay = _shape(320, 5, 160), Layout(micro=4, tp=2)
    for kind in KINDS:
        got = fitted_cost(parse_key(layer_key(kind, held, held_lay, 1)), profiles)
        want = cost(kind, held, held_lay)
        assert got.forward == pytest.approx(want.forward, rel=1e-9)
        assert got.backward == pytest.approx(want.backward, rel=1e-9)
    # another precision or thread count is another family: nothing to fit from
    assert fitted_cost(parse_key(layer_key("block", held, Layout(micro=4, precision="bf16"), 1)), profiles) is None
    assert fitted_cost(parse_key(layer_key("block", held, held_lay, 2)), profiles) is None


def test_layer_costs_prefer_a_profile_then_the_fit_then_flops() -> None:
    lay = Layout(micro=2)
    seen, other = _shape(192, 4, 96), _shape(320, 5, 96)
    profiles = {layer_key(k, seen, lay, 1): LayerCost(1e-3, 2e-3) for k in KINDS}
    rates = Rates(source="test", threads=1, flops={"fp32": 1e10}, memory_bandwidth=1e10, layers=profiles)
    assert layer_costs(seen, lay, rates)[0]["block"] == LayerCost(1e-3, 2e-3)  # its own profile
    fitted = layer_costs(other, lay, rates)[0]["block"]  # one profile: scaled by the matmul FLOPs
    flops = lambda s: work_terms("block", s.hidden, s.heads, s.vocab, s.seq, 2, 4, 1, 1)[0]  # noqa: E731
    assert fitted.forward == pytest.approx(1e-3 * flops(other) / flops(seen))
    bare = Rates(source="test", threads=1, flops={"fp32": 1e10}, memory_bandwidth=1e10)
    assert layer_costs(other, lay, bare)[0]["block"].forward == pytest.approx(flops(other) / 1e10)


def test_a_tiny_held_out_model_is_predicted_within_30_percent_of_its_measured_layers() -> None:
    """Real layers on this machine: three small shapes profiled, a fourth (other hidden, heads and sequence
    sizes, more layers) predicted from them and then measured. Its forward and backward over all of its
    layers must be within 30% (measured in development: 5-6% for this one, against 14-16% for the FLOPs
    estimate with the calibrated rate). Shapes smaller than these are mostly per-op overhead, which the
    work terms do not hold: with hidden sizes of 64-160 a full-suite run put the prediction 34-39% over."""
    torch.set_num_threads(1)
    lay = Layout(micro=2)
    held = _shape(224, 7, 160, layers=4)
    shapes = (_shape(192, 4, 96), _shape(256, 8, 64), _shape(128, 4, 192), held)
    # Each shape timed in three rounds, interleaved, its fastest kept: a slow spell of a shared machine then
    # costs a round, not the comparison (the first suite run saw the held-out model 34% off once).
    best: dict[ModelShape, dict[str, LayerCost]] = {}
    for _ in range(3):
        for shape in shapes:
            got = measure_layers(shape, lay, 1)
            old = best.setdefault(shape, got)
            best[shape] = {k: min(old[k], got[k], key=lambda c: c.forward + c.backward) for k in KINDS}
    profiles = {layer_key(kind, s, lay, 1): c for s in shapes[:-1] for kind, c in best[s].items()}
    predicted, _ = layer_costs(held, lay, Rates(source="test", threads=1, flops={"fp32": 1e10},
                                                memory_bandwidth=1e10, layers=profiles))
    measured = best[held]

    def total(c: dict[str, LayerCost]) -> float:
        return sum((c[k].forward + c[k].backward) * (held.layers if k == "block" else 1) for k in KINDS)

    assert total(predicted) == pytest.approx(total(measured), rel=0.30), (total(predicted), total(measured))


def test_an_unlaunched_kind_of_run_takes_the_overhead_of_the_nearest_one_launched() -> None:
    """What a run holds besides its tensors is measured per kind of run the calibration launched; a kind it
    never launched (most layouts a search tries) takes the kind with the most parts in common, ties to the
    larger, instead of per-process figures that leave out process groups and buffers."""
    from capstan.engine.plan.memory import nearest_family, runtime_family

    measured = {"dp2.tp1.pp1.z3.none.fp32": 300, "dp1.tp1.pp1.z0.disk.fp32": 250, "dp1.tp1.pp1.z0.none.fp32": 200}
    assert nearest_family(runtime_family(Layout(dp=2, zero_stage=3, offload="disk", cpu_budget=1 << 30)), measured) == \
        "dp2.tp1.pp1.z3.none.fp32"
    assert nearest_family("dp1.tp1.pp1.z0.none.fp32.rc", measured) == "dp1.tp1.pp1.z0.none.fp32"
    assert nearest_family("dp1.tp1.pp1.z0.none.fp32", {}) is None

