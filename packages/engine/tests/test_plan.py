"""capstan plan (engine/plan): parameter counts, memory per rank and tier, published arithmetic, bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from capstan.engine import cli
from capstan.engine.plan import (
    DEVICES,
    GB,
    MODELS,
    Layout,
    ModelShape,
    PlanError,
    machine_preset,
    memory_plan,
    min_devices_for_states,
)
from capstan.engine.zero.buckets import IN_FLIGHT
from capstan.native import standin


@pytest.mark.parametrize("tp", [1, 2])
def test_parameter_counts_equal_the_reference_gpt_per_layer(tp: int) -> None:
    from capstan.comm.job.groups import Group
    from capstan.tensorpar import GPTConfig, build_gpt

    with torch.device("meta"):
        model = build_gpt(GPTConfig(vocab_size=101, seq_len=16, d_model=32, n_heads=4, n_layers=3, dropout=0.0),
                          Group("tp", tuple(range(tp)), 0), seed=0)
    built = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    assert ModelShape(layers=3, hidden=32, heads=4, vocab=101, seq=16).layer_params(tp) == built


def test_a_trillion_parameters_need_16_TB_of_states_so_400_A100_40GB() -> None:
    """ZeRO-Infinity (Rajbhandari et al. 2021): 1T parameters -> ~16 TB of mixed-precision Adam states,
    at least 400 A100-40GB for the states alone (here the 1008B GPT of Narayanan et al. 2021)."""
    model = MODELS["gpt-1t"]
    assert 16.0e12 <= 16 * model.params <= 16.3e12
    assert 400 <= min_devices_for_states(model, DEVICES["a100-40gb"]) <= 410


def test_mt_nlg_530b_spans_280_a100_80gb_per_replica() -> None:
    """Smith et al. 2022: 8-way tensor x 35-way pipeline slicing, 280 A100-80GB per replica (bf16,
    recompute); on 40 GB devices the same layout does not fit."""
    model = MODELS["mt-nlg-530b"]
    layout = Layout(tp=8, pp=35, precision="bf16", recompute=True, accum=64)
    plan = memory_plan(model, machine_preset("dgx-a100-80gb", nodes=35), layout)
    assert plan.layout.dp == 1 and plan.machine.world == 280 and plan.fits, plan.table()
    assert 16 * plan.params_per_rank < 40 * GB  # its states alone would fit a 40 GB device...
    small = memory_plan(model, machine_preset("dgx-a100-40gb", nodes=35), layout)
    assert not small.fits and set(small.shortfall()) == {"device"}  # ...but not with the activations


def test_13b_on_one_v100_fits_only_with_the_optimizer_on_the_host() -> None:
    """ZeRO-Offload (Ren et al. 2021): 13B parameters train on one 32 GB V100 only with gradients and
    optimizer states on the host. In capstan ZeRO-3 on a GPU is such a layout even without offload: its
    chunks' home is RAM and the CPU Adam steps them (states/chunked.py), so the planner plans it as
    offload cpu, every tier's bytes the same."""
    model, v100 = MODELS["zero-offload-13b"], machine_preset("dgx-2", devices_per_node=1)
    base = {"precision": "fp16", "recompute": True, "micro": 4}
    assert memory_plan(model, v100, Layout(**base)).shortfall().keys() == {"device"}
    offload = memory_plan(model, v100, Layout(offload="cpu", **base))
    assert offload.fits, offload.table()
    assert offload.total("ram") > 150 * GB and offload.total("device") < 32 * GB
    zero3 = memory_plan(model, v100, Layout(zero_stage=3, **base))
    assert {t: zero3.total(t) for t in ("device", "ram")} == {t: offload.total(t) for t in ("device", "ram")}
    assert any("ZeRO-3 on a GPU keeps them in RAM" in i.what for i in zero3.items), zero3.table()


def test_model_states_follow_the_zero_formulas_of_docs_parallelism() -> None:
    """Flat ZeRO 0-2 buffers: 16, 8 + 8/dp and, at ZeRO 2 over overlapped buckets, 4 + 12/dp bytes per
    parameter plus IN_FLIGHT + 2 buckets (no flat gradient; the buckets together at most a quarter of it);
    8 + 12/dp without buckets (flat gradient and shard accumulator), 8 + 8/dp under a pipeline (the shard
    in place); ZeRO-3 chunks 16/dp in fp32, plus their padding."""
    model = ModelShape(layers=4, hidden=64, heads=4, vocab=256, seq=32)
    machine = machine_preset("local", ranks_per_node=4)
    psi = model.params

    def states(**kw: object) -> int:
        plan = memory_plan(model, machine, Layout(**kw))
        return sum(i.bytes for i in plan.items
                   if i.what.startswith(("parameters", "gradients", "Adam", "model states")))

    assert states(zero_stage=0) == 16 * psi
    assert states(zero_stage=1) == 8 * psi + 8 * psi // 4
    bucket = 4000  # bytes, well under the model's gradient
    lean = 4 * psi + 4 * psi // 4 + (IN_FLIGHT + 2) * bucket + 8 * psi // 4
    assert states(zero_stage=2, bucket_bytes=bucket) == states(zero_stage=2, accum=2, bucket_bytes=bucket) == lean
    # buckets of 25 MB, more than this model's gradient: capped so the four alive at once hold a quarter of it
    assert states(zero_stage=2) == 4 * psi + 12 * psi // 4 + (IN_FLIGHT + 2) * 4 * (psi // (4 * (IN_FLIGHT + 2)))
    assert states(zero_stage=2, bucket_bytes=0) == 8 * psi + 12 * psi // 4
    assert states(zero_stage=2, compression="int8") == 8 * psi + 12 * psi // 4  # reduced after backward
    # ZeRO-3: 16/dp of the chunk elements, lists padded to whole chunks and to a multiple of dp chunks
    # (what a real engine allocates: test_plan_time.py's test_sharded_chunks_are_what_each_rank_allocates)
    from capstan.engine.plan.chunks import chunk_lists

    lists = chunk_lists(model, Layout(zero_stage=3, dp=4), list(range(model.layers + 3)))
    assert states(zero_stage=3) == lists.state_bytes() >= 16 * psi // 4
    # bf16 moments (precision.optimizer_states): 4 bytes per parameter fewer, sharded as the moments are
    assert states(zero_stage=0, optimizer_states="bf16") == 12 * psi
    assert states(zero_stage=1, optimizer_states="bf16") == 8 * psi + 4 * psi // 4
    half = chunk_lists(model, Layout(zero_stage=3, dp=4, optimizer_states="bf16"), list(range(model.layers + 3)))
    assert half.bytes_per_element() == 12 and states(zero_stage=3, optimizer_states="bf16") == half.state_bytes()
    assert 4 * half.state_bytes() == 3 * lists.state_bytes()


def test_recompute_and_sequence_parallel_cut_activations() -> None:
    model = ModelShape(layers=8, hidden=256, heads=8, vocab=512, seq=256)
    machine = machine_preset("local", ranks_per_node=2)

    def acts(**kw: object) -> int:
        plan = memory_plan(model, machine, Layout(tp=2, micro=4, **kw))
        return sum(i.bytes for i in plan.items if i.what.startswith("activations"))

    plain, sp, recompute = acts(), acts(sequence_parallel=True), acts(recompute=True)
    assert recompute < sp < plain
    assert sp == pytest.approx(plain * 32 / 2 / (8 + 24 / 2), rel=1e-6)  # 32/t against 8 + 24/t (s b h units)


@pytest.mark.parametrize("make, message", [
    (lambda: ModelShape(layers=0, hidden=64, heads=4, vocab=256, seq=32),
     "model.layers = 0: must be a positive number"),
    (lambda: ModelShape(layers=2, hidden=66, heads=4, vocab=256, seq=32),
     "model.hidden = 66 is not divisible by model.heads = 4"),
    (lambda: memory_plan(MODELS["gpt3-1.3b"], machine_preset("dgx-h100"), Layout(tp=3)),
     "layout tp x pp = 3 x 1 does not divide the machine's 8 ranks"),
    (lambda: memory_plan(MODELS["gpt3-1.3b"], machine_preset("dgx-h100"), Layout(tp=8, pp=1, dp=2)),
     "layout dp x tp x pp = 2 x 8 x 1 = 16 ranks, but the machine has 8"),
    (lambda: memory_plan(MODELS["gpt3-1.3b"], machine_preset("dgx-h100", nodes=4), Layout(pp=32)),
     "layout pp x virtual_stages = 32 parts, more than the model's 27 layers"),
    (lambda: memory_plan(ModelShape(layers=2, hidden=60, heads=6, vocab=256, seq=32), machine_preset("dgx-h100"),
                         Layout(tp=4, dp=2)), "model.heads = 6 is not divisible by layout.tp = 4"),
    (lambda: machine_preset("tpu-v9"), "unknown machine preset 'tpu-v9'"),
    (lambda: Layout(offload="disk"), "layout.offload = \"disk\" needs layout.cpu_budget"),
    (lambda: Layout(micro=-1), "layout.micro = -1: must be a positive number"),
])
def test_impossible_specs_are_one_clear_error(make: object, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_capstan_plan_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--config", "examples/offload.toml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["layout"]["offload"] == "disk" and out["total"]["disk"] > 0
    assert out["total"]["ram"] >= 12 * 2**20  # the main job's 12 MiB chunk budget, plus the rest
    assert cli.main(["plan", "--model", "zero-offload-13b", "--machine", "v100-32gb", "--precision", "fp16",
                     "--recompute"]) == 1
    assert "does not fit: device short by" in capsys.readouterr().out
    assert cli.main(["plan", "--model", "zero-offload-13b", "--machine", "v100-32gb", "--precision", "fp16",
                     "--recompute", "--offload", "cpu"]) == 0
    assert cli.main(["plan", "--model", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["capstan: error: unknown model preset 'nope': expected one of " + ", ".join(MODELS)]
    assert cli.main(["plan", "--layers", "2"]) == 2
    assert "(missing --hidden, --heads, --vocab, --seq)" in capsys.readouterr().err


def test_patrickstar_12b_on_8_v100_needs_gpu_and_host_together() -> None:
    """Fang et al. 2022 (PatrickStar): a 12B GPT (60 x 4096) trains on 8 x V100-32GB with 240 GB of host RAM
    only with model data placed across GPU and host memory together. capstan keeps every state's chunk on
    the host on a GPU, ZeRO-3 without offload included (states/chunked.py: parameter chunks compute on
    the GPUs, the CPU Adam steps masters and moments in RAM), so the host is short: 18 B per parameter
    at dp > 1, and each chunk list padded to whole units of 8 chunks of the largest tensor (the
    125M-element embedding), 36.1 GB per rank of 30. With 320 GB of host RAM it fits. Holding optimizer
    chunks on the GPU (the optional part of the GPU issue) is what would close the gap; the plan names
    it, by how much."""
    machine = machine_preset("dgx-2", devices_per_node=8, host_ram=240 * GB)
    base = {"precision": "fp16", "recompute": True, "micro": 8, "zero_stage": 3}
    model = MODELS["patrickstar-12b"]
    no_offload = memory_plan(model, machine, Layout(**base))
    offload = memory_plan(model, machine, Layout(offload="cpu", **base))
    assert no_offload.shortfall() == offload.shortfall(), no_offload.table()
    assert set(offload.shortfall()) == {"ram"}, offload.table()
    assert 5 * GB < offload.shortfall()["ram"] < 8 * GB
    roomier = memory_plan(model, replace(machine, host_ram=320 * GB), Layout(offload="cpu", **base))
    assert roomier.fits, roomier.table()
    assert roomier.total("device") < 32 * GB and roomier.total("ram") > 30 * GB  # each tier holds its part


@pytest.mark.parametrize("device", [standin.param()])
def test_the_planner_counts_the_pinned_staging_pool_of_a_disk_tier_on_a_device(device: str, tmp_path) -> None:
    """Under a cpu budget on an accelerator chunkmem copies through pinned staging buffers counted in the
    budget (memory/transfer.py); the planner counts the same bytes, inside the budget and in its minimum."""
    from capstan import comm
    from capstan.engine import initialize
    from capstan.engine.plan.chunks import chunk_lists
    from capstan.engine.plan.run import shape_layout

    cfg = {"model": {"n_layers": 2, "n_heads": 4, "d_model": 64, "seq_len": 32},
           "train": {"device": device, "micro_batch_size": 2, "steps": 1},
           "memory": {"offload": "disk", "cpu_budget": 1 << 20, "chunk_size": 16384, "disk_dir": str(tmp_path)}}
    engine = initialize(config=cfg, groups=comm.single_process_groups())
    try:
        held = engine.manager.device_tier.staging_bytes()
        shape, layout = shape_layout(engine.config, world=1)
    finally:
        engine.close()
    lists = chunk_lists(shape, layout, list(range(shape.layers + 3)))
    assert held > 0 and lists.staging_bytes() == held
    gpu = machine_preset("h100-80gb", host_ram=64 << 30)
    plan = memory_plan(shape, gpu, layout)
    assert [i.bytes for i in plan.items if i.what.startswith("pinned staging")] == [held]
    tight = memory_plan(shape, gpu, replace(layout, cpu_budget=lists.minimum_budget() + held - 1))
    assert any("pinned staging buffers included" in p for p in tight.problems), tight.problems


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_the_planner_counts_a_bf16_masters_chunks_as_the_engine_allocates_them(master: str) -> None:
    """precision.master_weights: with int8 moments the chunks hold 8.03 B per element with an fp32 master
    (param 2, master 4, the gradient in the param's slot) and 6.03 with a bf16 one (param 2, grad 2); the
    planner's lists hold the bytes the engine's chunks do."""
    from capstan import comm
    from capstan.engine import initialize
    from capstan.engine.plan.chunks import chunk_lists
    from capstan.engine.plan.run import shape_layout

    cfg = {"model": {"n_layers": 2, "n_heads": 4, "d_model": 64, "seq_len": 32},
           "train": {"micro_batch_size": 2, "steps": 1}, "memory": {"offload": "cpu", "chunk_size": 16384},
           "precision": {"dtype": "bf16", "optimizer_states": "int8", "master_weights": master}}
    engine = initialize(config=cfg, groups=comm.single_process_groups())
    try:
        held = sum(e.chunk.nbytes for e in engine.manager.entries.values())
        shape, layout = shape_layout(engine.config, world=1)
    finally:
        engine.close()
    lists = chunk_lists(shape, layout, list(range(shape.layers + 3)))
    assert lists.bytes_per_element() == (6 if master == "bf16" else 8) + 2 / 64
    assert lists.state_bytes() == held
    # On a GPU a bf16 master's gradient chunks (2 B, chunks of their own) are on the device during backward
    # beside the parameters' two layers; an fp32 master's gradient sits in the 16-bit parameter's slot.
    device = {i.what: i.bytes for i in memory_plan(shape, machine_preset("h100-80gb"), layout).items
              if i.tier == "device" and "chunks" in i.what}
    layer = device["parameter chunks in use and prefetched (2 layers, 16-bit)"] // 4  # 2 layers of 2 B
    assert device.get("gradient chunks of the layer in backward") == (2 * layer if master == "bf16" else None)


def test_the_planner_counts_the_device_fallbacks_window_for_bf16_and_8bit_moments() -> None:
    """On a GPU the flat ZeRO 0-2 path steps bf16 and 8-bit moments in torch ops on the device
    (native/fallback.py), a window at a time: the planner counts one window's temporaries there."""
    from capstan.native.fallback import WINDOW_BYTES

    model, gpu = MODELS["gpt3-1.3b"], machine_preset("h100-80gb")

    def temporaries(states: str) -> list[int]:
        plan = memory_plan(model, gpu, Layout(optimizer_states=states))
        return [i.bytes for i in plan.items if i.what.startswith("optimizer step's temporaries")]

    assert temporaries("fp32") == [] and temporaries("bf16") == temporaries("int8") == [WINDOW_BYTES]
    # a bf16 master steps there in torch ops too, whatever its moments
    plan = memory_plan(model, gpu, Layout(precision="bf16", master_weights="bf16"))
    assert [i.bytes for i in plan.items if i.what.startswith("optimizer step's temporaries")] == [WINDOW_BYTES]


def test_capstan_plan_of_a_disk_config_without_a_budget(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A disk tier without memory.cpu_budget (what a DeepSpeed NVMe config becomes) is planned with the budget
    the machine's RAM leaves, as the engine runs it without one: the largest the RAM allows, or, where the
    states fit in RAM whole (this model), all of them."""
    path = tmp_path / "nvme.toml"
    path.write_text('[model]\nn_layers = 2\nn_heads = 4\nd_model = 64\nseq_len = 32\n[memory]\noffload = "disk"\n')
    assert cli.main(["plan", "--config", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["layout"]["offload"] == "disk"
    states = next(i["bytes"] for i in out["items"] if i["what"].startswith("model states in RAM"))
    assert out["layout"]["cpu_budget"] >= states > 0


def test_the_planner_counts_a_flat_bf16_master_as_the_optimizer_allocates_it() -> None:
    """precision.master_weights = "bf16" without chunks (ZeRO 0-2): the flat buffer's parameters and gradients
    are bf16, so the planner's flat items come to 4 B a parameter less than the fp32 master's, and to what
    ZeroOptimizer.state_bytes() holds (one process: parameters, gradients, fp32 moments)."""
    from capstan import comm
    from capstan.engine import initialize
    from capstan.engine.plan.run import shape_layout

    cfg = {"model": {"n_layers": 2, "n_heads": 4, "d_model": 64, "seq_len": 32},
           "train": {"micro_batch_size": 2, "steps": 1}, "precision": {"dtype": "bf16", "master_weights": "bf16"}}
    engine = initialize(config=cfg, groups=comm.single_process_groups())
    try:
        held, numel = engine.optimizer.state_bytes(), engine.optimizer.numel
        shape, layout = shape_layout(engine.config, world=1)
    finally:
        engine.close()

    def states(master: str) -> int:
        plan = memory_plan(shape, machine_preset("local"), replace(layout, master_weights=master))
        return sum(i.bytes for i in plan.items if i.what.startswith(("parameters (", "gradients (", "Adam moments")))

    assert states("bf16") == held == 12 * numel
    assert states("fp32") - states("bf16") == 4 * numel
