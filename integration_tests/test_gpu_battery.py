"""The GPU battery (tools/gpu/battery.sh) on the CPU suite's stand-in accelerator, so CI keeps it working
for the rare GPU machine: its parity part runs end to end through the battery's own entry point and
leaves the summary a GPU run would leave; the pieces that judge (the parity verdict, the summary's
status, the scale search) are checked to fail where they must.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capstan.native import standin

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


parity = _load("capstan_gpu_parity", ROOT / "tools" / "gpu" / "parity.py")
summary = _load("capstan_gpu_summary", ROOT / "tools" / "gpu" / "summary.py")
bench = _load("capstan_bench_gpu", ROOT / "tools" / "bench_gpu.py")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not standin.available(),
                    reason="no stand-in device here (it needs torch's C++ headers and a C++ compiler)")
def test_the_battery_parity_part_on_the_standin(tmp_path: Path) -> None:
    """`battery.sh --device standin --part 1 --only parity`, 6 steps, ZeRO-3 on two ranks sharing standin:0:
    every layout within 1e-6 of the CPU, and the summary (JSON and Markdown) says so."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(OUT=str(out), PYTHON=sys.executable, CAPSTAN_PARITY_ARGS="--steps 6 --shared dp2-zero3")
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu" / "battery.sh"), "--device", "standin", "--part", "1",
                           "--only", "parity"], capture_output=True, text=True, timeout=170, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    part = json.loads((out / "summary.json").read_text())["parts"]["1"]
    assert part["device"] == "standin" and part["status"] == "ok", part
    assert list(part["steps"]) == ["parity"], part["steps"]  # --only: nothing else ran
    step = part["steps"]["parity"]
    assert step["status"] == "ok" and step["rc"] == 0 and step["seconds"] < 120, step
    report = step["result"]
    assert report["ok"] and report["steps"] == 6 and report["tol_loss"] == 1e-6 and not report["errors"]
    expected = {"offload none", "offload cpu", "offload disk", "offload disk fused", "int8 offload none",
                "int8 offload cpu", "dp2-zero3 rank 0", "dp2-zero3 rank 1"}
    assert set(report["layouts"]) == expected
    for name, layout in report["layouts"].items():
        assert layout["ok"] and layout["max_rel_loss"] <= 1e-6, (name, layout)
        assert layout["device"] == "standin:0", (name, layout["device"])  # the two ranks share one device
        assert len(layout["loss"]) == len(layout["cpu_loss"]) == 6
    md = (out / "summary.md").read_text()
    assert "## Part 1 on standin: ok" in md and "**Parity on standin**: ok, 6 steps" in md, md
    assert "| dp2-zero3 rank 1 |" in md and "| parity | ok |" in md, md


@pytest.mark.timeout(120)
@pytest.mark.skipif(not standin.available(),
                    reason="no stand-in device here (it needs torch's C++ headers and a C++ compiler)")
def test_the_battery_profiles_a_step_in_both_parts(tmp_path: Path) -> None:
    """`--only profile,profile-peers,cpu-kernels`: each part profiles capstan's step on the device (offload
    none, cpu, and cpu with a clip that never fires in part 1, beside plain PyTorch's step on the same model;
    cpu in part 2) and its log names
    the phases that take the time. The first lease's profile, run beside the battery, died on `import
    capstan`: now it is a step of its own. Part 1 also tests and times the host's CPU Adam kernels (the
    offload steps' optimizer) on every ISA the CPU has: a GPU host's AVX-512 paths run nowhere else."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(OUT=str(out), PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu" / "battery.sh"), "--device", "standin",
                           "--only", "profile,profile-peers,cpu-kernels"], capture_output=True, text=True, timeout=110,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = json.loads((out / "summary.json").read_text())["parts"]
    assert list(parts["1"]["steps"]) == ["profile", "cpu-kernels"], parts
    assert list(parts["2"]["steps"]) == ["profile-peers"], parts
    first, second = (out / "profile.log").read_text(), (out / "profile-peers.log").read_text()
    assert "=== offload none on standin:0" in first and "=== offload cpu on standin:0" in first, first[-2000:]
    assert "=== offload cpu on standin:0" in second and "offload none" not in second, second[-2000:]
    for log in (first, second):
        assert "capstan phases" in log and "capstan::Engine.step" in log, log[-2000:]
    assert "capstan::ChunkAdam._update" in second, second[-2000:]  # the chunked step's own phases
    # plain PyTorch's step profiled alike in part 1, its phases labelled, host time and launches counted
    assert "=== plain PyTorch on standin:0" in first and "plain PyTorch" not in second, first[-2000:]
    for phase in ("plain::forward", "plain::backward", "plain::step"):
        assert phase in first, first[-3000:]
    assert first.count("kernel launches a step") == 4, first[-3000:]
    assert "=== offload cpu-noclip on standin:0" in first, first[-3000:]  # the update guessed beside backward
    kernels = (out / "cpu-kernels.log").read_text()
    assert parts["1"]["steps"]["cpu-kernels"]["status"] == "ok", kernels[-3000:]
    for module in ("test_adam_q8.py", "test_adam_bf16_master.py"):
        assert module in kernels, kernels[-3000:]
    assert " passed" in kernels and " failed" not in kernels, kernels[-3000:]
    for variant in ("fp32 moments", "bf16 moments", "8-bit moments", "copy_ of 16 B/param"):
        assert variant in kernels, kernels[-3000:]


def _traj(losses: list[float], device: str = "standin:0") -> dict:
    return {"loss": losses, "norm": [1.0] * len(losses), "device": device, "moved": 0, "device_bytes": []}


def test_parity_verdict_fails_past_the_tolerance() -> None:
    cpu = _traj([5.0, 4.0, 3.0], "cpu")
    assert parity.compare(cpu, _traj([5.0, 4.0, 3.0 * (1 + 5e-7)]), "standin", 3)["ok"]
    bad = parity.compare(cpu, _traj([5.0, 4.0, 3.0 * (1 + 2e-6)]), "standin", 3)
    assert not bad["ok"] and "loss differs" in bad["problems"][0]
    assert parity.compare(cpu, _traj([5.0, 4.0, 3.0 * (1 + 2e-6)], "cuda:0"), "cuda", 3)["ok"]  # 1e-4 there
    assert not parity.compare(cpu, _traj([5.0, 4.0, 3.0], "cpu"), "standin", 3)["ok"]  # never left the CPU
    assert not parity.compare(cpu, _traj([5.0, 4.0]), "standin", 3)["ok"]  # a step missing
    assert parity.compare(cpu, _traj([5.0, 4.0, 3.0 * (1 + 6e-6)]), "standin", 3, low_bit=True)["ok"]  # 8-bit codes
    assert not parity.compare(cpu, _traj([5.0, 4.0, 3.0 * (1 + 2e-5)]), "standin", 3, low_bit=True)["ok"]
    budget = parity.compare(cpu, {**_traj([5.0, 4.0, 3.0]), "moved": 1, "device_bytes": [(10, 200, 5)]},
                            "standin", 3, budget=100)
    assert not budget["ok"] and "budget" in budget["problems"][0]


def test_summary_status_of_a_part(tmp_path: Path) -> None:
    """A failing step fails the part (exit 1 at `end`), a step cut short by its deadline leaves it
    incomplete, a skip with its reason keeps it ok; summary.md names each."""
    run = lambda *a: summary.main([*a, "--out", str(tmp_path), "--part", "1", "--device", "standin"])  # noqa: E731
    run("begin", "--budget", "540")
    run("step", "--name", "tests", "--skipped", "needs a GPU")
    run("step", "--name", "build", "--rc", "0", "--seconds", "3")
    assert run("end") == 0
    (tmp_path / "bench.json").write_text(json.dumps({"incomplete": ["scale: capstan offload cpu"]}))
    run("step", "--name", "scale", "--rc", "0", "--seconds", "300", "--result", str(tmp_path / "bench.json"))
    assert run("end") == 1
    assert json.loads((tmp_path / "summary.json").read_text())["parts"]["1"]["status"] == "incomplete"
    run("step", "--name", "parity", "--rc", "1", "--seconds", "30")
    assert run("end") == 1
    md = (tmp_path / "summary.md").read_text()
    assert "Part 1 on standin: failed" in md and "| parity | failed |" in md and "needs a GPU" in md, md
    assert "| scale | incomplete |" in md and "cut short by the deadline" in md, md


def test_a_missing_baseline_leaves_its_step_incomplete(tmp_path: Path) -> None:
    """A target's ratio needs both rows: plain PyTorch (or a peer) failing leaves the ratio unmeasured, and
    the step says so instead of passing as ok (capstan failing fails it, as before)."""
    run = lambda *a: summary.main([*a, "--out", str(tmp_path), "--part", "2", "--device", "standin"])  # noqa: E731
    run("begin", "--budget", "540")
    (tmp_path / "bench.json").write_text(json.dumps({"unmeasured": ["peers: deepspeed zero-offload: exit 1: boom"],
                                                     "incomplete": [], "failed": []}))
    run("step", "--name", "peers", "--rc", "0", "--seconds", "100", "--result", str(tmp_path / "bench.json"))
    assert run("end") == 1
    step = json.loads((tmp_path / "summary.json").read_text())["parts"]["2"]["steps"]["peers"]
    assert step["status"] == "incomplete" and "not measured: peers: deepspeed" in step["reason"]


def test_a_failed_measurement_is_named_by_its_error_not_cudas_advice(capsys) -> None:
    """CUDA ends an error's message with lines of advice; the error named is the line before them, an
    out-of-memory anywhere in the exception's end counts as one (a pinned host allocation's CUDA error
    included), a warning earlier in the run does not, and the child's last lines reach the step's log."""
    advice = ["CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace",
              "below might be incorrect.", "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
              "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.", ""]
    crash = ["Traceback (most recent call last):", '  File "x.py", line 1', "RuntimeError: CUDA error: an illegal "
             "memory access was encountered", *advice]
    assert bench._why(1, crash) == ("exit 1: Traceback (most recent call last): | File \"x.py\", line 1 | "
                                    "RuntimeError: CUDA error: an illegal memory access was encountered")
    pinned = ["Traceback (most recent call last):", "torch.AcceleratorError: CUDA error: out of memory", *advice]
    assert bench._why(1, pinned) == "out of memory"
    early = ["warning: a probe ran out of memory and was retried smaller", *(f"step {i}" for i in range(20)),
             "ValueError: bad config"]
    assert bench._why(1, early).startswith("exit 1:") and "ValueError: bad config" in bench._why(1, early)
    refused = ['capstan: error: memory.offload = "cpu": the model states of the 1 rank(s) on this node do not fit '
               "its RAM: they need at least 144.0 GiB of it (...)"]
    assert bench._why(2, refused) == "out of memory"  # capstan's room check at start: a size limit
    bench._echo("speed", b"line one\nline two\n")
    assert "speed failed; its last 2 lines:\n  line one\n  line two" in capsys.readouterr().err


def test_scale_search_finds_the_largest_and_says_when_it_was_cut() -> None:
    clock = iter(range(10_000)).__next__  # one "second" per reading
    found = bench.search_largest(lambda n: n <= 37, 8, deadline=10_000, resolution=1.0, clock=clock)
    assert (found["layers"], found["fails_at"], found["end"]) == (37, 38, "found")
    found = bench.search_largest(lambda n: n <= 37, 100, deadline=10_000, resolution=1.25, clock=clock)
    assert found["end"] == "found" and 37 / 1.25 <= found["layers"] <= 37 < found["fails_at"]
    assert bench.search_largest(lambda n: False, 4, 10_000, clock=clock)["end"] == "none fits"
    capped = bench.search_largest(lambda n: True, 4, 10_000, cap=64, clock=clock)
    assert (capped["layers"], capped["end"]) == (64, "cap")
    now = [0.0]

    def slow(n: int) -> bool:
        now[0] += 100.0  # each probe takes 100 s: after 3 probes the next would pass the deadline
        return True

    cut = bench.search_largest(slow, 1, deadline=250.0, clock=lambda: now[0])
    assert cut["end"] == "deadline" and cut["layers"] == 2 and len(cut["probes"]) == 2, cut
    # A probe stopped by the deadline says nothing of its size: not a failure (a fails_at would be wrong)
    timed_out = bench.search_largest(lambda n: True if n < 40 else None, 30, 10_000, resolution=1.5, clock=clock,
                                     grow=1.5)
    assert (timed_out["layers"], timed_out["fails_at"], timed_out["end"]) == (30, None, "deadline"), timed_out
    assert timed_out["probes"][-1][:2] == (45, None)
    # From a good estimate, steps of the resolution bracket the answer in two probes (the scale section's
    # way: a GPU lease has time for a few probes of billions of parameters), up or down.
    for start, want in ((30, [(30, True), (45, False)]), (45, [(45, False), (30, True)])):
        near = bench.search_largest(lambda n: n <= 37, start, 10_000, resolution=1.5, clock=clock, grow=1.5)
        assert [p[:2] for p in near["probes"]] == want and near["end"] == "found", near
        assert near["layers"] == 30 and near["fails_at"] == 45
    # ... and walk there from a poor one, a step of the resolution at a time
    far = bench.search_largest(lambda n: n <= 37, 4, 10_000, resolution=1.5, clock=clock, grow=1.5)
    assert far["end"] == "found" and far["fails_at"] / far["layers"] <= 1.5 and far["layers"] <= 37 < far["fails_at"]
    # Resumed from what an earlier lease saw fit (--scale-known): the first probe is a step above it, and one
    # failing probe ends the search; where nothing new fits in time the known size stands, cut short
    resumed = bench.search_largest(lambda n: n <= 37, 4, 10_000, resolution=1.5, clock=clock, grow=1.5, known=30)
    assert [p[:2] for p in resumed["probes"]] == [(45, False)], resumed  # (30 itself: the earlier lease's)
    assert (resumed["layers"], resumed["fails_at"], resumed["end"]) == (30, 45, "found"), resumed
    higher = bench.search_largest(lambda n: n <= 37, 4, 10_000, resolution=1.25, clock=clock, grow=1.5, known=20)
    assert [p[:2] for p in higher["probes"]][0] == (30, True) and higher["layers"] <= 37 < higher["fails_at"]
    # (a step of the resolution from a size that does not divide evenly: 133 x 1.5 = 199.5, probed at 200)
    odd = bench.search_largest(lambda n: n <= 133, 4, 10_000, resolution=1.5, clock=clock, grow=1.5, known=133)
    assert [p[:2] for p in odd["probes"]] == [(200, False)] and odd["end"] == "found", odd
    ratios = bench._scale_ratios({"plain PyTorch": {"layers": 140, "params": 7, "end": "found", "from_earlier": True},
                                  "capstan offload disk": {"layers": 187, "params": 9, "end": "found"}})
    assert list(ratios) == ["scale: capstan / plain PyTorch (target >= 3.0) (a size an earlier lease measured)"]
    unanswered = bench.search_largest(lambda n: None, 4, 10_000, resolution=1.5, clock=clock, grow=1.5, known=30)
    assert (unanswered["layers"], unanswered["fails_at"], unanswered["end"]) == (30, None, "deadline"), unanswered


def test_a_scale_search_split_over_two_runs_keeps_the_first_runs_systems() -> None:
    earlier = {"scale": {"d_model": 2048, "systems": {"plain PyTorch": {"layers": 115, "params": 6, "end": "found"},
                                                      "capstan offload disk": {"layers": 1, "end": "deadline"}}}}
    kept = bench.earlier_scale(earlier, 2048, {"capstan offload disk"})
    assert kept == {"plain PyTorch": {"layers": 115, "params": 6, "end": "found", "earlier": True}}
    assert bench.earlier_scale(earlier, 1024, set()) == {} and bench.earlier_scale({}, 2048, set()) == {}


def test_scale_systems_are_picked_by_name() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--sections", "scale", "--scale-systems", "cpu,gpu"])
