"""The GPU battery's parity part: training on a device equals training on the CPU.

    python tools/gpu/parity.py --device cuda --json /tmp/capstan-gpu/parity.json
    python tools/gpu/parity.py --device standin --steps 6 --shared dp2-zero3   # the CPU's stand-in

Each layout trains the reference GPT (2 layers, d 32) for `--steps` steps on the device and the same
layout on the CPU, in the same process, with TF32 off; every step's loss must agree within `TOL`
relative and every gradient norm within `NORM_TOL`:

* one rank: offload none, offload cpu (chunks audited at every move), offload disk (a device budget of
  3 chunks and a RAM budget of 8: chunks move device <-> RAM <-> disk every step, and the device tier's
  counted bytes must be real allocations within the budget), and 8-bit Adam moments
  (precision.optimizer_states = "int8") with offload none (stepped on the device by torch's ops) and cpu;
* two ranks sharing the one device (`SHARED`: dp 2 ZeRO-1, tp 2, pp 2, pp 2 with offload, dp 2 ZeRO-3
  chunks, and ZeRO-3 under a device budget). NCCL refuses two ranks on one GPU, so their device tensors
  travel through host memory (docs/gpu.md, communication). On the stand-in the ranks share
  ``standin:0`` (``CAPSTAN_STANDIN_DEVICES=1``).

Tolerances: on a GPU 1e-4 for losses and 1e-3 for norms (its kernels sum in other orders and its fused
AdamW rounds differently from the CPU's native kernel, so not the 1e-5 between CPU layouts). The
stand-in runs the CPU's own kernels, so there losses within 1e-6 (measured: about 1e-7 over 20 steps,
last-bit roundings that differ between the device and the CPU paths of the optimizer) and norms within
1e-5 (a norm of gradients amplifies those roundings about tenfold: 1.1e-6 measured at tp 2); with 8-bit
moments 1e-5 and 1e-4 (LOW_BIT_TOL: such a last bit can move a code by a whole step; 5.7e-6 and 1.3e-5
measured over 20 steps, as the suite's own stand-in test of low-bit states allows).

Every group of layouts runs in fresh processes under its own time limit (the stand-in must be loaded
before a process's first backward, and a hang must not cost the battery its summary); the report says
per layout what ran, the largest differences and whether it passed, and under "incomplete" what the
deadline or a group's time limit cut short. The exit status is 1 when a layout failed (or a rank
raised), else 0: "ok" in the report says whether everything ran and passed. integration_tests/test_gpu.py
(the `cuda` tests) uses the same functions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

__all__ = ["STEPS", "CHUNK", "TOL", "NORM_TOL", "SHARED", "config", "no_tf32", "load_device", "trajectory",
           "single_layouts", "compare", "run_parity"]

STEPS = 20
CHUNK = 8192  # elements per chunk: small enough that the 2-layer model spans many chunks
TOL = {"cuda": 1e-4, "standin": 1e-6}
NORM_TOL = {"cuda": 1e-3, "standin": 1e-5}
# 8-bit moments on the stand-in: a last-bit difference before a code's stochastic rounding can move the code
# a whole step (test_standin_device.py's low-bit states: 1e-5); on a GPU the tolerances above already hold it
LOW_BIT_TOL = {"cuda": 1e-4, "standin": 1e-5}
LOW_BIT_NORM_TOL = {"cuda": 1e-3, "standin": 1e-4}


def config(device: str, **sections: dict) -> dict:
    """The parity runs' reference GPT config on `device`, with `sections` merged over the base."""
    base = {"model": {"n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16},
            "data": {"max_bytes": 200_000},
            "train": {"steps": STEPS, "micro_batch_size": 2, "grad_accum_steps": 2, "lr": 1e-2, "min_lr": 1e-3,
                      "warmup_steps": 2, "grad_clip": 0.5, "weight_decay": 0.1, "device": device}}
    for name, body in sections.items():
        base[name] = {**base.get(name, {}), **body}
    return base


def no_tf32() -> None:
    """fp32 matmuls and convolutions in full fp32 (TF32 would differ from the CPU by ~1e-3)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def load_device(device: str) -> None:
    """Make `device` usable in this process: the stand-in is loaded (before any backward), CUDA needs nothing."""
    if device == "standin":
        from capstan.native import standin

        standin.load()


def trajectory(cfg: dict, steps: int | None = None, audit: bool = False, save_at: int = 0,
               save_dir: str = "", load: str = "") -> dict:
    """Train `cfg` to step `steps` (default: its train.steps), resumed from checkpoint `load`, saved into
    `save_dir` after step `save_at`. Returns the losses, gradient norms, the device, and per step the
    device tier's (resident, peak) bytes beside what the device allocator holds."""
    from capstan.comm.job.accelerator import device_module
    from capstan.engine import initialize, open_data, train_batches

    no_tf32()
    steps = cfg["train"]["steps"] if steps is None else steps
    engine = initialize(config=cfg)
    if load:
        engine.load(load)
    if audit and engine.chunked:
        engine.manager.audit_moves = True  # recount every tier (and each chunk's device) at every move
    it = train_batches(open_data(engine.config), engine.config, engine.groups.dp.size, engine.groups.dp.rank,
                       start_step=engine.global_step)
    infos, device_bytes = [], []
    for _ in range(engine.global_step, steps):
        infos.append(engine.train_batch(it))
        if engine.chunked and engine.manager.dev is not None:
            device_bytes.append((engine.manager.dev.resident, engine.manager.dev.stats.peak_bytes,
                                 device_module(engine.device).memory_allocated(engine.device)))
        if save_at and engine.global_step == save_at:
            engine.save(save_dir)
    out = {"loss": [i.loss for i in infos], "norm": [i.grad_norm for i in infos], "device_bytes": device_bytes,
           "device": str(engine.device), "moved": infos[-1].mem["mem.moved_bytes"] if infos else 0,
           "mem": infos[-1].mem if infos else {}}
    engine.close()
    if engine.device.type != "cpu":
        device_module(engine.device).empty_cache()
    return out


def single_layouts(device: str, disk_dir: str) -> dict[str, dict]:
    """One rank: name -> the config sections on the device (the CPU reference drops gpu_budget)."""
    del device  # the same layouts on every device
    int8 = {"precision": {"optimizer_states": "int8"}}
    return {"offload none": {"memory": {}},
            "offload cpu": {"memory": {"offload": "cpu", "chunk_size": CHUNK}},
            # 3 chunks on the device and 8 in RAM: chunks move device <-> RAM <-> disk every step; the step
            # streams past RAM with clipping (it guesses, taken back from the disk where it clipped)
            "offload disk": {"memory": {"offload": "disk", "chunk_size": CHUNK, "cpu_budget": 8 * CHUNK * 4,
                                        "gpu_budget": 3 * CHUNK * 4, "disk_dir": disk_dir}},
            # the step streamed past RAM: each chunk group updated during backward, in autograd's device thread
            # (no clipping: chunkmem overlap.py, "Past RAM")
            "offload disk fused": {"memory": {"offload": "disk", "chunk_size": CHUNK, "cpu_budget": 12 * CHUNK * 4,
                                              "gpu_budget": 3 * CHUNK * 4, "disk_dir": disk_dir + "-fused",
                                              "overlap_optimizer": True}, "train": {"grad_clip": 0.0}},
            # 8-bit moments: on the device through torch's ops (offload none), in RAM through the native kernel
            "int8 offload none": {"memory": {}, **int8},
            "int8 offload cpu": {"memory": {"offload": "cpu", "chunk_size": CHUNK}, **int8}}


# Two ranks on the one device: name -> sections of the config (the same on the CPU, less gpu_budget).
SHARED = {
    "dp2-zero1": {"train": {"grad_accum_steps": 1}, "parallel": {"dp": 2, "zero_stage": 1}},
    # ZeRO-2 without a flat gradient: 4 KiB buckets packed on the device, two micro-batches into the shard
    "dp2-zero2": {"train": {"grad_accum_steps": 2}, "parallel": {"dp": 2, "zero_stage": 2, "bucket_mb": 1 / 256}},
    "tp2": {"parallel": {"dp": 1, "tp": 2}},
    "pp2": {"parallel": {"dp": 1, "pp": 2}},
    "pp2-offload": {"parallel": {"dp": 1, "pp": 2}, "memory": {"offload": "cpu", "chunk_size": CHUNK}},
    # ZeRO-3 chunks: gathered units and gradient reductions on the (shared) device
    "dp2-zero3": {"train": {"grad_accum_steps": 1}, "parallel": {"dp": 2, "zero_stage": 3},
                  "memory": {"chunk_size": CHUNK}},
    "dp2-zero3-budget": {"train": {"grad_accum_steps": 1}, "parallel": {"dp": 2, "zero_stage": 3},
                         "memory": {"chunk_size": CHUNK, "gpu_budget": 12 * CHUNK * 4}},
}


def _on_cpu(sections: dict) -> dict:
    memory = {k: v for k, v in sections.get("memory", {}).items() if k != "gpu_budget"}
    return {**sections, "memory": memory}


def _single_ranks(device: str, steps: int, disk_dir: str, names: list[str]) -> dict:
    """In a rank of its own: each one-rank layout on the CPU, then on `device`."""
    load_device(device)
    out = {}
    for name, sections in single_layouts(device, disk_dir).items():
        if name not in names:
            continue
        cpu = trajectory(config("cpu", **_on_cpu(sections)), steps)
        dev = trajectory(config(device, **sections), steps, audit=bool(sections["memory"]))
        out[name] = (cpu, dev)
    return out


def _shared_ranks(device: str, steps: int, names: list[str]) -> dict:
    """On each of two ranks sharing one device: each layout of `names` on the CPU, then on `device`."""
    from capstan import comm

    load_device(device)
    out = {}
    for name in names:
        sections = SHARED[name]
        cpu = trajectory(config("cpu", **_on_cpu(sections)), steps)
        dev = trajectory(config(device, **sections), steps, audit="memory" in sections)
        out[name] = (cpu, dev)
    out["transport"] = comm.transport()  # on one GPU: "host" (NCCL refuses two ranks on one device)
    return out


def _worst(got: list[float], want: list[float]) -> float:
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for x, y in zip(got, want, strict=True):
        if not (math.isfinite(x) and math.isfinite(y)):
            worst = max(worst, 0.0 if x == y else math.inf)
        else:
            worst = max(worst, abs(x - y) / abs(y) if y else abs(x))
    return worst


def compare(cpu: dict, dev: dict, device: str, steps: int, budget: int | None = None, low_bit: bool = False
            ) -> dict:
    """The parity verdict of one layout: largest relative differences of losses and norms, and the device
    checks (it ran on the device, and under a budget the tier's counted bytes are real and within it).
    low_bit: 8-bit moments (LOW_BIT_TOL)."""
    tol, norm_tol = (LOW_BIT_TOL, LOW_BIT_NORM_TOL) if low_bit else (TOL, NORM_TOL)
    loss, norm = _worst(dev["loss"], cpu["loss"]), _worst(dev["norm"], cpu["norm"])
    problems = []
    if len(dev["loss"]) != steps:
        problems.append(f"{len(dev['loss'])} of {steps} steps")
    if not dev["device"].startswith(device):
        problems.append(f"trained on {dev['device']}")
    if loss > tol[device]:
        problems.append(f"loss differs by {loss:.2e} > {tol[device]:.0e}")
    if norm > norm_tol[device]:
        problems.append(f"gradient norm differs by {norm:.2e} > {norm_tol[device]:.0e}")
    if budget is not None:
        if dev["moved"] <= 0:
            problems.append("no chunk moved under the budget")
        for held, peak, allocated in dev["device_bytes"]:
            if peak > budget or held > allocated:
                problems.append(f"device tier peak {peak} (budget {budget}), held {held} > allocated {allocated}")
                break
    return {"ok": not problems, "max_rel_loss": loss, "max_rel_norm": norm, "problems": problems,
            "device": dev["device"], "loss": dev["loss"], "cpu_loss": cpu["loss"]}


def _launch(fn, world: int, args: tuple, timeout: float, env: dict | None, init: bool) -> tuple[list | None, str]:
    from capstan.comm.testing import run_ranks

    try:
        return run_ranks(fn, world, *args, timeout=timeout, init=init, env=env), ""
    except Exception as exc:  # a rank's failure or a timeout: recorded, the battery goes on
        return None, f"{type(exc).__name__}: {exc}"[-4000:]


def run_parity(device: str, steps: int = STEPS, single: list[str] | None = None, shared: list[str] | None = None,
               timeout: float = 300.0, deadline_s: float = math.inf) -> dict:
    """Every layout of `single` (one rank) and `shared` (two ranks on one device) on `device` against the
    CPU; each group in fresh processes within `timeout` seconds, all of them within `deadline_s`.
    Returns the report (see the module docstring)."""
    deadline = time.monotonic() + deadline_s
    single = list(single_layouts(device, "")) if single is None else single
    shared = list(SHARED) if shared is None else shared
    report: dict = {"device": device, "steps": steps, "tol_loss": TOL[device], "tol_norm": NORM_TOL[device],
                    "layouts": {}, "errors": {}, "incomplete": []}
    # two ranks, one device: the stand-in's first, or the first GPU this process may see
    env = ({"CAPSTAN_STANDIN_DEVICES": "1"} if device == "standin"
           else {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]})
    with tempfile.TemporaryDirectory(prefix="capstan-parity-") as tmp:
        groups = [("one rank", 1, _single_ranks, (device, steps, tmp, single), single, False),
                  ("two ranks sharing the device", 2, _shared_ranks, (device, steps, shared), shared, True)]
        for label, world, fn, args, names, init in groups:
            if not names:
                continue
            t0 = time.monotonic()
            left = deadline - t0
            if left < 10:
                report["incomplete"].append(f"{label}: not started, the deadline was reached")
                continue
            results, error = _launch(fn, world, args, min(timeout, left), env, init)
            report.setdefault("seconds", {})[label] = round(time.monotonic() - t0, 1)
            if results is None:
                if "timed out after" in error.splitlines()[0]:  # the group's time limit: cut, not failed
                    report["incomplete"].append(f"{label}: stopped at its time limit ({min(timeout, left):.0f} s)")
                else:
                    report["errors"][label] = error
                continue
            budgets = {n: m["memory"].get("gpu_budget") for n, m in single_layouts(device, "").items()}
            for rank, result in enumerate(results):
                transport = result.pop("transport", None)
                if device == "cuda" and world > 1:  # (the stand-in stages its tensors whatever comm says)
                    report["transport"] = transport
                    if transport != "host":
                        report["errors"][label] = f"ranks sharing one GPU used transport {transport!r}, not 'host'"
                for name, (cpu, dev) in result.items():
                    key = name if world == 1 else f"{name} rank {rank}"
                    budget = budgets.get(name) if world == 1 else None
                    report["layouts"][key] = compare(cpu, dev, device, steps, budget, low_bit=name.startswith("int8"))
    # ok: everything ran and passed; failed (exit 1): something ran and failed; otherwise incomplete
    report["failed"] = bool(report["errors"]) or any(not r["ok"] for r in report["layouts"].values())
    report["ok"] = bool(report["layouts"]) and not report["failed"] and not report["incomplete"]
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "standin"))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--single", default="all", help="comma-separated one-rank layouts, 'all' or 'none'")
    ap.add_argument("--shared", default="all", help=f"comma-separated two-rank layouts of {', '.join(SHARED)}, "
                                                    "'all' or 'none'")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for each group of layouts")
    ap.add_argument("--deadline", type=float, default=math.inf, help="seconds for all of it")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)

    def names(text: str, every: list[str]) -> list[str]:
        chosen = every if text == "all" else [] if text == "none" else text.split(",")
        unknown = sorted(set(chosen) - set(every))
        if unknown:
            ap.error(f"unknown layout(s) {unknown}; choose from {every}")
        return chosen

    report = run_parity(args.device, args.steps, names(args.single, list(single_layouts(args.device, ""))),
                        names(args.shared, list(SHARED)), args.timeout, args.deadline)
    for name, r in report["layouts"].items():
        verdict = "ok " if r["ok"] else "FAIL"
        diffs = (f"loss {r['max_rel_loss']:.1e} norm {r['max_rel_norm']:.1e}" if "max_rel_loss" in r else "")
        print(f"  {verdict} {name:28s} {diffs} {'; '.join(r['problems'])}")
    verdict = "ok" if report["ok"] else "FAILED" if report["failed"] else "incomplete"
    print(f"parity on {args.device}: {verdict} (tolerance {report['tol_loss']:.0e} "
          f"relative on losses, {report.get('seconds', {})})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    for what in report["incomplete"]:
        print(f"  cut short: {what}")
    return 1 if report["failed"] else 0  # an incomplete run exits 0 and says so in its report


if __name__ == "__main__":
    raise SystemExit(main())
