"""The engine's real device path on the stand-in accelerator (capstan.native.standin), against the CPU.

The stand-in is not the CPU: its tensors report ``standin:<i>`` and an op mixing one with a CPU tensor
raises as on CUDA, so every run below would fail on a tensor left behind (a module buffer, a batch, an
optimizer scalar). It computes with the CPU's kernels, so each run must match the same run on the CPU:
losses within 1e-6 relative (the flat optimizer takes torch's fused AdamW on a device and the native
kernel on the CPU, which round differently in the last bit). Each launch runs every case of its world
size in one process per rank (the stand-in takes torch's PrivateUse1 slot for the whole process).
"""

from __future__ import annotations

import contextlib

import pytest

from capstan.comm.testing import run_ranks
from capstan.engine.testing import tiny_gpt_config
from capstan.native import standin

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not standin.available(),
                                 reason="no stand-in device here (it needs torch's C++ headers and a C++ compiler)")]

TOL = 1e-6
STEPS = 6


def _config(device: str, memory: dict, dtype: str = "fp32", states: str = "fp32", master: str = "fp32",
            **parallel) -> dict:
    return tiny_gpt_config(STEPS, 2, precision={"dtype": dtype, "optimizer_states": states, "master_weights": master},
                           train={"device": device}, parallel=parallel, memory=memory)


def _run(cfg: dict, eval_after: int | None = None, model=None) -> dict:
    import torch

    from capstan.engine import initialize, open_data, train_batches

    engine = initialize(model=model, config=cfg)
    data = open_data(engine.config)
    it = train_batches(data, engine.config, engine.groups.dp.size, engine.groups.dp.rank)
    from capstan.comm.job.accelerator import is_accelerator
    from capstan.native import standin

    counting = is_accelerator(engine.device)
    losses, evals, moments, syncs = [], [], [], []
    for step in range(STEPS):
        before = standin.host_syncs() if counting else 0
        losses.append(engine.train_batch(it).loss)
        syncs.append(standin.host_syncs() - before if counting else 0)
        if eval_after is not None and step + 1 == eval_after:
            held = [next(train_batches(data, engine.config, engine.groups.dp.size, engine.groups.dp.rank))]
            evals.append(engine.eval_batch(held))
            moments.append(engine.manager.moment if engine.chunked else 0)
    mem = engine.memory_stats()
    spec = getattr(engine.optimizer, "speculation", None)  # the overlapped step's counters (chunkmem overlap.py)
    paths = {} if spec is None else {"rollbacks": spec.rollbacks, "declined": spec.declined,
                                     "stepped_early": spec.stepped_early, "streamed": spec.streamed,
                                     "pending": len(engine.optimizer.pending)}
    # Buffers stay where forward runs; parameters too without chunks (chunked ones are views of chunks,
    # which wait in RAM between steps after the CPU optimizer stepped them).
    params = set() if engine.chunked else {str(p.device) for p in engine.module.parameters()}
    devices = sorted(params | {str(b.device) for b in engine.module.buffers()})
    engine.close()
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()
    return {"losses": losses, "evals": evals, "moments": moments, "mem": mem, "devices": devices, "syncs": syncs,
            "paths": paths}


def _llama():
    import torch
    import transformers

    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    import torch
    import transformers

    torch.manual_seed(7)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


SINGLE = {
    "none": ({}, {}),
    "cpu-measured": ({"offload": "cpu"}, {}),  # the budget follows the measured activations; overlapped step
    "cpu-budget": ({"offload": "cpu", "gpu_budget": "256KiB"}, {}),
    "cpu-eval": ({"offload": "cpu", "gpu_budget": "256KiB"}, {"eval_after": 3}),
}


def _single(tmp: str) -> dict:
    import torch

    from capstan.native import standin

    torch.set_num_threads(1)
    standin.load()
    cases = dict(SINGLE)
    cases["disk"] = ({"offload": "disk", "cpu_budget": "2MiB", "gpu_budget": "256KiB", "disk_dir": tmp}, {})
    # recomputed blocks' inputs away between forward and recompute: to pinned RAM from the device, to disk on
    # the CPU (chunkmem's ActivationOffload), both against the same training
    cases["act-offload"] = ({"activation_checkpointing": True, "activation_offload": True, "disk_dir": tmp}, {})
    out = {}
    for name, (memory, extra) in cases.items():
        cpu_memory = {k: v for k, v in memory.items() if k != "gpu_budget"}
        out[name] = (_run(_config("cpu", cpu_memory), **extra), _run(_config("standin", memory), **extra))
    # Past RAM on the device, the step streamed (chunkmem overlap.py): without clipping each chunk group is
    # updated during backward, in autograd's device thread; against the CPU's plain step after backward.
    noclip = {**cases["disk"][0], "overlap_optimizer": True}
    cpu_cfg, dev_cfg = _config("cpu", {**cases["disk"][0], "gpu_budget": None}), _config("standin", noclip)
    for cfg in (cpu_cfg, dev_cfg):
        cfg["train"]["grad_clip"] = 0.0
    out["disk-fused"] = (_run(cpu_cfg), _run(dev_cfg))
    # ... with clipping that never fires: each step's update guessed during backward and kept (its chunks
    # protected in the disk's second slots); "disk" above clips every step: its first guess is taken back and
    # each later step measures the norm in backward and leaves its update to the next forward (pending).
    never = {**cases["disk"][0], "overlap_optimizer": True}
    cpu_cfg, dev_cfg = _config("cpu", {**never, "gpu_budget": None}), _config("standin", never)
    for cfg in (cpu_cfg, dev_cfg):
        cfg["train"]["grad_clip"] = 100.0
    out["disk-guess"] = (_run(cpu_cfg), _run(dev_cfg))
    for offload in ("none", "cpu"):  # autocast: CUDA's policy on the stand-in, the CPU's on the CPU
        out[f"bf16-{offload}"] = tuple(_run(_config(d, {"offload": offload}, dtype="bf16")) for d in ("cpu", "standin"))
        # bf16 moments: on the device through torch's ops (kernels' fallback), in chunks through the native kernel
        for states in ("bf16", "int8"):
            out[f"{states}-states-{offload}"] = tuple(_run(_config(d, {"offload": offload}, states=states))
                                                      for d in ("cpu", "standin"))
    # a bf16 master: bf16 parameter and gradient chunks between the device and RAM, stepped in RAM; or the
    # flat buffer's bf16 parameters and gradients on the device, stepped there through torch's ops
    for offload in ("none", "cpu"):
        out[f"bf16-master-{offload}"] = tuple(_run(_config(d, {"offload": offload}, dtype="bf16", master="bf16"))
                                              for d in ("cpu", "standin"))
    hf = {"model": {"seq_len": 16}, "data": {"max_bytes": 100_000},
          "train": {"steps": STEPS, "micro_batch_size": 2, "lr": 3e-3, "lr_schedule": "constant",
                    "warmup_steps": 0, "grad_clip": 1.0}}
    for family, build in (("llama", _llama), ("gpt2", _gpt2)):
        for offload in ("none", "cpu"):
            runs = []
            for device in ("cpu", "standin"):
                cfg = {**hf, "train": {**hf["train"], "device": device}, "memory": {"offload": offload}}
                runs.append(_run(cfg, model=build()))
            out[f"{family}-{offload}"] = tuple(runs)
    return out


def _pair(device: str, tmp: str) -> dict:
    import torch

    from capstan.native import standin

    torch.set_num_threads(1)
    if device == "standin":
        standin.load()
    return {"z3": _run(_config(device, {}, dp=2, zero_stage=3)),
            "z2": _run(_config(device, {}, dp=2, zero_stage=2, bucket_mb=1 / 64)),  # packed buckets on the device
            "pp2": _run(_config(device, {}, pp=2))}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_ranks(_single, 1, str(tmp_path_factory.mktemp("disk")), init=False, timeout=280)[0]


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= TOL * abs(w), (got, want)


@pytest.mark.parametrize("case", [*SINGLE, "disk", "disk-fused", "disk-guess", "act-offload"])
def test_reference_gpt_on_the_standin_matches_the_cpu(single, case: str) -> None:
    cpu, dev = single[case]
    _close(dev["losses"], cpu["losses"])
    if case == "act-offload":  # the blocks' inputs really left: to pinned RAM on the device, to disk on the CPU
        assert dev["mem"]["mem.act.offloaded_total_bytes"] > 0 and cpu["mem"]["mem.act.offloaded_total_bytes"] > 0
    assert dev["devices"] in (["standin:0"], [])  # buffers (and unchunked parameters) where forward runs
    if case != "none":  # chunks on the device, counted by the tier and by the device allocator
        assert dev["mem"]["mem.standin.peak_bytes"] > 0
        assert dev["mem"]["mem.standin.reserved_peak_bytes"] >= dev["mem"]["mem.standin.peak_bytes"]


def test_past_ram_the_device_takes_each_path_of_the_overlapped_step(single) -> None:
    """The three ways a step runs past RAM all ran on the stand-in, as on the CPU: streamed without clipping,
    guessed and kept where clipping never fires, and where every step clips a guess taken back once, then
    every step measuring and leaving its update to the next forward (so a later edit cannot quietly turn a
    case into another)."""
    for case in ("disk", "disk-fused", "disk-guess"):
        cpu, dev = single[case]
        assert dev["paths"] == cpu["paths"], case
    fused, guess, clips = (single[c][1]["paths"] for c in ("disk-fused", "disk-guess", "disk"))
    assert fused["streamed"] > 0 and fused["rollbacks"] == fused["pending"] == 0
    assert guess["stepped_early"] > 0 and guess["rollbacks"] == guess["declined"] == guess["pending"] == 0
    assert clips["rollbacks"] == 1 and clips["declined"] == STEPS - 1 and clips["pending"] > 0


@pytest.mark.parametrize(("case", "most"), [("none", 2), ("cpu-measured", 1), ("cpu-budget", 1), ("disk", 1)])
def test_a_step_makes_the_host_wait_for_the_device_at_most_once_or_twice(single, case: str, most: int) -> None:
    """Host syncs a GPU would make per step of two micro-batches (standin.host_syncs: .item(), blocking or
    pageable copies): the loss, read once at the step's end, and without chunks the gradient norm for
    clipping. Not per micro-batch (the loss), per segment (the norm), per collective on a group of one
    (staged copies), or per batch copied from pageable memory."""
    _, dev = single[case]
    assert max(dev["syncs"][1:]) <= most, dev["syncs"]  # after the warm-up step


def test_eval_between_steps_leaves_the_trace_alone(single) -> None:
    """An eval after step 3 neither moves the next step's starting moment nor changes its trajectory."""
    cpu, dev = single["cpu-eval"]
    assert dev["moments"] == [0] and cpu["moments"] == [0]
    assert dev["evals"] == pytest.approx(cpu["evals"], rel=TOL)
    _close(dev["losses"], single["cpu-budget"][1]["losses"])  # the same run without the eval


@pytest.mark.parametrize("case", ["bf16-none", "bf16-cpu"])
def test_bf16_autocast_on_the_standin_follows_the_cpu_trajectory(single, case: str) -> None:
    """bf16 under autocast: the stand-in casts by CUDA's op lists, the CPU by its own, so the losses are a
    trajectory within BF16_VS_CPU of each other (capstan.comm.testing.devices), not bits."""
    from capstan.comm.testing import BF16_VS_CPU

    cpu, dev = single[case]
    assert dev["losses"] == pytest.approx(cpu["losses"], rel=BF16_VS_CPU)
    assert dev["losses"] != cpu["losses"]  # the two policies differ: the stand-in really took CUDA's


@pytest.mark.parametrize("case", ["bf16-states-none", "bf16-states-cpu", "int8-states-none", "int8-states-cpu"])
def test_low_bit_optimizer_states_on_the_standin_follow_the_cpu(single, case: str) -> None:
    """precision.optimizer_states = "bf16" or "int8" on a device: the flat buffer's moments live there and
    step through torch's ops (fallback.adam_step / adam_step_q8), whose stochastic rounding draws the native
    kernel's bits and codes; chunked, they step in RAM. Within 1e-5: the device's AdamW rounds its fp32
    arithmetic differently in the last bit (see TOL), and a stochastic rounding can carry such a bit further
    (test_optimizer_states.py)."""
    cpu, dev = single[case]
    assert dev["losses"] == pytest.approx(cpu["losses"], rel=1e-5)
    fp32_states = single["none" if case.endswith("none") else "cpu-measured"][1]
    assert dev["losses"] != fp32_states["losses"]  # the moments really were bf16 / 8-bit


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_bf16_master_on_the_standin_follows_the_cpu_trajectory(single, offload: str) -> None:
    """precision.master_weights = "bf16". Chunks in RAM: bf16 parameter and gradient chunks move between the
    device and RAM (nothing fp32 left behind on either side) and step in RAM through the native kernel. The
    flat ZeRO buffer (offload none): bf16 parameters and gradients on the device, stepped there by the
    kernels' torch-op fallback with the CPU kernel's rounding bits. Under autocast the stand-in takes CUDA's
    op lists, so a trajectory within BF16_VS_CPU of the CPU's, and not the fp32 master's."""
    from capstan.comm.testing import BF16_VS_CPU

    cpu, dev = single[f"bf16-master-{offload}"]
    assert dev["losses"] == pytest.approx(cpu["losses"], rel=BF16_VS_CPU)
    assert dev["devices"] in (["standin:0"], [])
    assert dev["losses"] != single[f"bf16-{offload}"][1]["losses"]  # the same run with an fp32 master: another one


@pytest.mark.parametrize("case", ["llama-none", "llama-cpu", "gpt2-none", "gpt2-cpu"])
def test_transformers_models_with_buffers_on_the_standin(single, case: str) -> None:
    """Llama's rotary frequencies and GPT-2's buffers reach the device with chunked memory too."""
    cpu, dev = single[case]
    _close(dev["losses"], cpu["losses"])
    # Llama holds its rotary frequencies in a buffer; this transformers' GPT-2 holds none
    assert "cpu" not in dev["devices"]
    if case.startswith("llama"):
        assert dev["devices"] == ["standin:0"]


@pytest.mark.mpirun
def test_zero3_and_pipeline_on_two_standin_devices(tmp_path) -> None:
    """dp 2 ZeRO-3, ZeRO-2 (its gradients packed into buckets on the device, no flat gradient) and pp 2,
    each rank on its own stand-in device (standin:0, standin:1; collectives staged through RAM), against the
    same layouts on the CPU; pp 2's host syncs per step."""
    dev = run_ranks(_pair, 2, "standin", str(tmp_path), timeout=280)
    cpu = run_ranks(_pair, 2, "cpu", str(tmp_path), timeout=280)
    for rank in range(2):
        _close(dev[rank]["z3"]["losses"], cpu[rank]["z3"]["losses"])
        _close(dev[rank]["z2"]["losses"], cpu[rank]["z2"]["losses"])
        z2 = dev[rank]["z2"]["mem"]
        assert z2["mem.standin.grad_peak_bytes"] == cpu[rank]["z2"]["mem"]["mem.cpu.grad_peak_bytes"]
        # resident: fp32 parameters (4 B each), the shard gradient (4/2) and the moments (8/2): 10 B per
        # parameter, of which a flat gradient would be 4
        assert z2["mem.standin.grad_peak_bytes"] < z2["mem.standin.resident_bytes"] * 4 / 10
        assert dev[rank]["z3"]["devices"] in ([], [f"standin:{rank}"])  # chunked: buffers only (none here)
    _close(dev[1]["pp2"]["losses"], cpu[1]["pp2"]["losses"])
    # The last stage reads its loss once a step, not once a micro-batch: one host sync more than the first
    # stage (measured 8 against 7 a step of 2 micro-batches; 9 when each micro-batch's loss was read)
    first, last = (dev[r]["pp2"]["syncs"][1:] for r in range(2))
    assert max(last) <= max(first) + 1, (first, last)


def _adds_and_skips() -> dict:
    """One process on the stand-in: in-place adds dispatched in a flat fp32 step after the first (a GPU
    launch each); and fp16 with a loss scale that overflows, on the stand-in and on the CPU."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from capstan.engine import initialize, open_data, train_batches
    from capstan.native import standin

    torch.set_num_threads(1)
    standin.load()

    class Adds(TorchDispatchMode):
        count = fused = norms = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func.__name__.startswith("add_"):
                Adds.count += 1
            if func.__name__.startswith("_fused_adamw_"):
                Adds.fused += 1
            if func.__name__.startswith("_foreach_norm"):
                Adds.norms += 1
            return func(*args, **(kwargs or {}))

    cfg = tiny_gpt_config(3, 1, train={"device": "standin"})
    engine = initialize(config=cfg)
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    engine.train_batch(it)
    with Adds():
        engine.train_batch(it)
    out = {"adds": Adds.count, "fused": Adds.fused, "params": len(engine.optimizer.params),
           "direct": engine.optimizer.direct}
    engine.close()
    for device in ("cpu", "standin"):  # (a scale at which step 2 overflows and the others step)
        precision = {"dtype": "fp16", "initial_scale": 2.0**20, "hysteresis": 1}
        engine = initialize(config=tiny_gpt_config(6, 2, precision=precision, train={"device": device}))
        it = train_batches(open_data(engine.config), engine.config, 1, 0)
        Adds.norms = 0
        with Adds() if device == "standin" else contextlib.nullcontext():
            out[device] = [(i.skipped, i.loss_scale, i.loss) for i in (engine.train_batch(it) for _ in range(6))]
        out["clip"] = engine.config.train.grad_clip
        engine.close()
    out["norms"] = Adds.norms  # the stand-in's fp16 steps: per-gradient norm passes
    return out


@standin.requires()
def test_a_flat_step_on_a_device_keeps_autograds_gradients() -> None:
    """One replica on a device, fp32: the gradients stay autograd's own tensors, assigned by backward as in
    plain PyTorch, and step in one fused call per weight decay; before, each was added into the flat buffer
    (a launch per parameter a step: 54 of 340 operators in the overhead-bound stand-in step of
    docs/benchmarks.md, "Sixteenth session"). fp16's overflow check skips the steps the CPU skips and the
    others step as there (losses within fp16 autocast's difference between the two op lists)."""
    got = run_ranks(_adds_and_skips, 1, init=False, timeout=120)[0]
    assert got["direct"] and got["params"] >= 10
    assert got["adds"] <= 2, got  # (no add per parameter)
    assert got["fused"] == 2, got  # decayed and not
    cpu, dev = got["cpu"], got["standin"]
    assert [s[:2] for s in dev] == [s[:2] for s in cpu], got
    assert any(s[0] for s in cpu) and not all(s[0] for s in cpu), got  # some steps skip, some step
    assert dev[-1][2] == pytest.approx(cpu[-1][2], rel=1e-4) and dev[-1][2] < dev[0][2] - 0.3, got
    # One pass over the gradients a step: the overflow check and the clipping norm share its norms (they
    # took one each, so a step that stepped took two).
    assert got["clip"] and got["norms"] == len(dev), got
