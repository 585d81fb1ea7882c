"""Benchmark: capstan on one GPU against a plain PyTorch loop, FSDP2 with CPU offload and DeepSpeed.

    python tools/bench_gpu.py --quick                     # speed and peers on a ~0.1B GPT (a few minutes)
    python tools/bench_gpu.py --d-model 2048 --layers 24  # the same on a 1.3B GPT
    python tools/bench_gpu.py --sections scale            # the largest GPT each system trains a step of
    python tools/bench_gpu.py --device standin --tiny     # every section on the CPU's stand-in (a minute)

Every figure comes from the same run on the same device (docs/benchmarks.md says which). Each
measurement (tools/gpu/systems.py) runs in a subprocess of its own, so one system's memory (or its
out-of-memory error) never touches the next; `--deadline` bounds the whole run (each subprocess gets what
is left), and the JSON report is rewritten after every section, so a run stopped from outside keeps what it measured.
Sections (`--sections`, default speed,peers):

* ``speed``: tokens/s of capstan (train.device = the device, bf16, ZeRO 0, fused AdamW on the device)
  over a plain loop over the same model (torch.optim.AdamW(fused=True), bf16 autocast,
  clip_grad_norm_), target >= 0.95x; and capstan with memory.offload = "cpu" (16-bit parameter chunks
  on the device, fp32 masters and Adam moments in RAM, the native CPU Adam) over capstan without
  offload, target >= 0.5x. With TFLOPS (6 x params x tokens/s) and, on CUDA, the model FLOPs
  utilization against the dense bf16 matmul rate measured at start.
* ``peers``: capstan offload cpu against FSDP2 (`fully_shard` per block) with `CPUOffloadPolicy` and
  bf16 `MixedPrecisionPolicy`, the optimizer stepping on the CPU (PyTorch's own offload), and
  DeepSpeed ZeRO-Offload (stage 2, optimizer on the CPU, DeepSpeedCPUAdam) where deepspeed imports
  (carry its wheel in; its CPU Adam builds at first use), target: capstan >= 1.5x; on the same model
  and batch.
* ``scale``: the largest GPT (d_model fixed, layers searched from an estimate of what each system's
  memory holds, a step of `--scale-resolution` up or down until the answer changes, then bisection to
  it) that trains one step: plain PyTorch (all on the device) and capstan with offload cpu and disk
  (`--disk DIR`, RAM as the engine's default budget unless `--cpu-budget`); FSDP2 and DeepSpeed too
  with `--scale-peers`; `--scale-systems` picks some (a lease's calls split them). Each system gets a
  share of the time left; a search cut short says so ("end": "deadline") and gives the bounds it had.

``--device standin`` runs all of it on the CPU suite's stand-in accelerator (capstan.native.standin,
loaded in each subprocess before anything else) with `--tiny` sizes, in fp32 (torch's autocast has no
stand-in kernels), and its memory capped by ``--standin-memory`` so the scale search ends: a check that
the benchmark runs end to end and fits its time, never a measurement of speed. FSDP2 (it needs a
process group with a backend on the device) and DeepSpeed (not installed there) are recorded as
skipped with the reason, as is anything else that cannot run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 50304


def _gpt_config(args: argparse.Namespace, layers: int | None = None, d_model: int | None = None) -> dict:
    d = d_model or args.d_model
    return {"model": {"n_layers": layers or args.layers, "n_heads": max(1, d // 64), "d_model": d,
                      "seq_len": args.seq, "vocab_size": args.vocab},
            "data": {"source": "stdlib", "max_bytes": 4_000_000},
            "train": {"steps": args.steps, "micro_batch_size": args.micro, "grad_accum_steps": 1, "lr": 1e-4,
                      "min_lr": 1e-5, "warmup_steps": 0, "grad_clip": 1.0, "device": args.device},
            "precision": {"dtype": args.dtype},
            "log": {"run_dir": str(Path(tempfile.gettempdir()) / "capstan-bench-gpu")}}


def _params(layers: int, d: int, vocab: int) -> int:
    return layers * 12 * d * d + 2 * vocab * d


# ---- the parent: subprocesses, the deadline, skips --------------------------------------------------
class Runner:
    """Starts each measurement in a subprocess on `args.device` within what is left of the deadline."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.earlier: dict = {}  # the --scale-earlier report (main)
        self.deadline = time.monotonic() + args.deadline if args.deadline else math.inf

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def __call__(self, kind: str, cfg: dict, timeout: float | None = None) -> dict:
        timeout = min(timeout or self.args.timeout, self.left())
        if timeout < 5:
            return {"error": "not started: the run's deadline (--deadline) was reached"}
        load = "from capstan.native import standin; standin.load(); " if self.args.device == "standin" else ""
        # faulthandler: a measurement that hangs leaves its threads' stacks in its stderr before it is killed
        code = (f"import faulthandler, json, sys; faulthandler.dump_traceback_later({max(1.0, timeout - 5):.0f}); "
                f"{load}sys.path.insert(0, {str(ROOT / 'tools' / 'gpu')!r}); import systems; "
                f"print('RESULT ' + json.dumps(systems.{kind}(json.loads(sys.argv[1]))))")
        env = dict(os.environ)
        if self.args.device == "standin":
            env.update(CAPSTAN_STANDIN_DEVICES="1", CAPSTAN_STANDIN_MEMORY=str(self.args.standin_memory))
        t0 = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True,
                                  timeout=timeout, env=env)
        except subprocess.TimeoutExpired as exc:
            _echo(kind, exc.stderr)
            return {"error": f"timed out after {timeout:.0f} s", "wall_s": round(time.monotonic() - t0, 1)}
        wall = round(time.monotonic() - t0, 1)
        for line in done.stdout.splitlines():
            if line.startswith("RESULT "):
                return {**json.loads(line[7:]), "wall_s": wall}
        _echo(kind, done.stderr or done.stdout)
        return {"error": _why(done.returncode, (done.stderr or done.stdout).strip().splitlines()), "wall_s": wall}


ECHO_LINES = 60


def _echo(kind: str, text: str | bytes | None) -> None:
    """A failed measurement's own output, its last ECHO_LINES lines, on this process's stderr (the battery
    keeps it in the step's log): its error line alone often is not enough, and a CUDA error's message ends
    in several lines of advice that would leave nothing else."""
    if isinstance(text, bytes):  # (a timeout's partial output is bytes even with text=True)
        text = text.decode(errors="replace")
    lines = (text or "").rstrip().splitlines()[-ECHO_LINES:]
    if lines:
        print(f"bench_gpu: {kind} failed; its last {len(lines)} lines:", *("  " + x for x in lines), sep="\n",
              file=sys.stderr)


OOM_TEXTS = ("out of memory", "outofmemory", "can't allocate memory", "cannot allocate memory",
             "states do not fit", "do not fit its disk", "do not fit its ram",  # (capstan's room check at start)
             "no space left on device")


# The advice CUDA appends to an error's message (c10's cuda check suffix): never the error itself.
ADVICE = ("cuda kernel errors might be asynchronously reported", "below might be incorrect",
          "for debugging consider passing",
          "compile with `torch_use_cuda_dsa`", "search for `cuda", "device-side assertions")


def _why(code: int, lines: list[str]) -> str:
    """A failed measurement's error from its whole output: "out of memory" for every way a size limit shows
    (the device's allocator, a pinned host allocation's CUDA error, the host's allocator, a full disk, the
    host's out-of-memory killer's SIGKILL), else its last three lines that are not CUDA's advice. Only the
    end is read (the exception and its chained causes), not a warning earlier in the run."""
    said = [x for x in lines if x.strip() and not any(a in x.lower() for a in ADVICE)]
    if any(t in x.lower() for x in said[-12:] for t in OOM_TEXTS):
        return "out of memory"
    if code == -9:
        return "out of memory (killed by SIGKILL: the host's out-of-memory killer, most likely)"
    return f"exit {code}: " + " | ".join(x.strip() for x in said[-3:])


def _cut(error: str) -> bool:
    """Whether a measurement's error is the deadline's (not started, or stopped at its time limit)."""
    return error.startswith(("not started", "timed out"))


@functools.cache
def _has_deepspeed() -> bool:
    """Whether DeepSpeed imports here, tried in a child process: a wheel installed with --no-deps is found
    by `find_spec` even where a dependency it imports is missing, and would then fail as an error row
    instead of a recorded skip."""
    try:
        return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def peer_skips(device: str) -> dict[str, str]:
    """The peers that cannot run on `device`, with the reason (recorded in the report, never silent)."""
    skips = {}
    if device != "cuda":
        skips["FSDP2 CPUOffloadPolicy"] = (f"FSDP2 needs a process group with a backend on the device "
                                           f"(cpu:gloo,cuda:nccl); {device} has none")
    if not _has_deepspeed():
        skips["DeepSpeed ZeRO-Offload"] = "deepspeed does not import here (carry its wheel in .whl/)"
    elif device != "cuda":
        skips["DeepSpeed ZeRO-Offload"] = f"DeepSpeed's accelerators do not include {device}"
    return skips


def _throughput(rows: dict, tokens: int, peak: float | None) -> None:
    for r in rows.values():
        if "step_s" in r:
            r["tokens_per_s"] = tokens / r["step_s"]
            r["tflops"] = 6 * r["params"] * tokens / r["step_s"] / 1e12
            if peak:
                r["mfu"] = r["tflops"] / peak


def _print_rows(rows: dict) -> None:
    width = max([24, *map(len, rows)])
    for name, r in rows.items():
        if "step_s" in r:
            mfu = f" (MFU {r['mfu']:.2f})" if "mfu" in r else ""
            print(f"  {name:{width}s} {r['step_s'] * 1e3:8.1f} ms/step {r['tokens_per_s']:10.0f} tok/s "
                  f"{r['tflops']:8.3f} TFLOPS{mfu} peak device {r['peak_device'] / 2**30:.2f} GiB")
        else:
            print(f"  {name:{width}s} {'skipped: ' + r['skipped'] if 'skipped' in r else r.get('error')}")


def _ratio(rows: dict, a: str, b: str) -> float | None:
    """How many times faster `a` steps than `b` (None where either did not run)."""
    ra, rb = rows.get(a, {}), rows.get(b, {})
    return rb["step_s"] / ra["step_s"] if "step_s" in ra and "step_s" in rb else None


# ---- sections -----------------------------------------------------------------------------------------
NOCLIP = "capstan offload cpu, clip not firing"


def speed(args: argparse.Namespace, run: Runner, report: dict) -> None:
    cfg = _gpt_config(args)
    peak = None
    if args.device == "cuda":
        peak = run("matmul_rate", cfg, 120).get("tflops")
    else:
        report["skipped"]["matmul rate"] = f"no matmul rate on {args.device}: its speed is the host's"
    report["matmul_tflops"] = peak
    rows = {"plain PyTorch": run("run_plain", cfg), "capstan": run("run_capstan", cfg),
            "capstan offload cpu": run("run_capstan", {**cfg, "memory": {"offload": "cpu"}}),
            # The bench clips at 1.0 from fresh weights, and a step that clips (or follows one that did) updates
            # after backward; where clipping rarely fires (most steps of a long run) the step guesses it will not
            # and updates beside backward (chunkmem optim/overlap.py): that case, with a clip no gradient reaches
            NOCLIP: run("run_capstan", {**cfg, "memory": {"offload": "cpu"},
                                        "train": {**cfg["train"], "grad_clip": 1e6}})}
    _throughput(rows, args.micro * args.seq, peak)
    report["speed"] = rows
    print(f"speed: GPT {rows['capstan'].get('params', 0) / 1e6:.1f}M, micro-batch {args.micro} x {args.seq} "
          f"tokens, {args.dtype} on {args.device}" + (f"; dense bf16 matmul {peak:.0f} TFLOPS" if peak else ""))
    _print_rows(rows)
    report["ratios"].update({
        "capstan / plain (target >= 0.95)": _ratio(rows, "capstan", "plain PyTorch"),
        "capstan offload / capstan (target >= 0.5)": _ratio(rows, "capstan offload cpu", "capstan"),
        "capstan offload, clip not firing / capstan": _ratio(rows, NOCLIP, "capstan")})


def peers(args: argparse.Namespace, run: Runner, report: dict) -> None:
    cfg = _gpt_config(args, args.peers_layers, args.peers_d_model)
    skips = peer_skips(args.device)
    rows = {"capstan offload cpu": run("run_capstan", {**cfg, "memory": {"offload": "cpu"}})}
    for name, kind in (("FSDP2 CPUOffloadPolicy", "run_fsdp"), ("DeepSpeed ZeRO-Offload", "run_deepspeed")):
        if name in skips:
            rows[name] = {"skipped": skips[name]}
            report["skipped"][f"peers: {name}"] = skips[name]
        else:
            rows[name] = run(kind, cfg)
    _throughput(rows, args.micro * args.seq, report.get("matmul_tflops"))
    report["peers"] = rows
    print(f"peers: GPT {rows['capstan offload cpu'].get('params', 0) / 1e6:.1f}M, micro-batch {args.micro} x "
          f"{args.seq} tokens on {args.device}")
    _print_rows(rows)
    report["ratios"].update({
        "capstan offload / DeepSpeed ZeRO-Offload (target >= 1.5)":
            _ratio(rows, "capstan offload cpu", "DeepSpeed ZeRO-Offload"),
        "capstan offload / FSDP2 CPUOffloadPolicy": _ratio(rows, "capstan offload cpu", "FSDP2 CPUOffloadPolicy")})


def search_largest(fits, start: int, deadline: float, resolution: float = 1.25, cap: int = 1 << 16,
                   clock=time.monotonic, grow: float = 2.0, known: int = 0) -> dict:
    """The largest n >= 1 with fits(n) true, assuming fits is monotone: from `start`, times `grow` (or
    over it) until the answer changes, then bisecting until hi / lo <= `resolution`. From a good
    estimate, `grow` = `resolution` brackets the answer in two probes (a probe of billions of parameters
    takes a minute or more on a GPU machine: docs/benchmarks.md, "GPU"). A probe is started
    only when the last one's time fits before `deadline` (clock() seconds); n never passes `cap`.
    fits(n) may return None: that probe ran out of time, which says nothing of n (the search ends there, at
    the deadline). Returns lo ("layers": the largest that fit, 0 if none), hi ("fails_at": the smallest
    that failed, None if none), the probes (n, fit (None: cut), seconds), and how the search ended
    ("end": "found", "none fits", "cap" (lo is the cap: at least this) or "deadline" (cut short: lo is a
    lower bound)). `known`: a size that an earlier run saw fit (an earlier lease's probe): lo starts there and
    the first probe is one `grow` above it (or `start`, if larger), so a search resumed across leases does
    not spend a probe again on what it found; lo stays `known` until a larger size fits."""
    probes: list[tuple[int, bool | None, float]] = []
    lo, hi = min(max(0, known), cap), None
    n, last = max(1, min(start, cap)), 0.0
    if lo:
        n = min(cap, max(n, lo + 1, math.ceil(lo * grow)))
        if lo >= cap:
            return {"layers": lo, "fails_at": None, "end": "cap", "probes": probes}
    while True:
        if clock() + last > deadline:
            end = "deadline"
            break
        t0 = clock()
        verdict = fits(n)
        last = clock() - t0
        if verdict is None:  # the probe itself was cut by the deadline: it says nothing of the size
            probes.append((n, None, round(last, 1)))
            end = "deadline"
            break
        ok = bool(verdict)
        probes.append((n, ok, round(last, 1)))
        lo, hi = (n, hi) if ok else (lo, n)
        if hi is None:
            if n >= cap:
                end = "cap"
                break
            n = min(cap, max(n + 1, math.ceil(n * grow)))
        elif lo == 0:
            if n == 1:
                end = "none fits"
                break
            n = max(1, min(n - 1, int(n / grow)))
        elif hi - lo <= 1 or hi <= math.ceil(lo * resolution):  # (a step of `resolution` rounds up)
            end = "found"
            break
        else:
            n = (lo + hi) // 2
    return {"layers": lo, "fails_at": hi, "end": end, "probes": probes}


# The scale searches' systems by their short names (--scale-systems, --scale-known)
SCALE_NAMES = {"plain": "plain PyTorch", "cpu": "capstan offload cpu", "disk": "capstan offload disk",
               "fsdp": "FSDP2 CPUOffloadPolicy", "deepspeed": "DeepSpeed ZeRO-Offload"}


def _meminfo_available() -> int:
    from capstan.comm.health.procmem import mem_available_bytes

    return mem_available_bytes() or 16 << 30


def scale(args: argparse.Namespace, run: Runner, report: dict) -> None:
    d = args.scale_d_model
    per_layer = 12 * d * d
    info = run("device_info", _gpt_config(args, 1, d), 120)
    free = info.get("free") or 0
    ram = _meminfo_available()
    disk_dir = args.disk or str(Path(tempfile.gettempdir()) / "capstan-bench-disk")
    Path(disk_dir).mkdir(parents=True, exist_ok=True)
    disk = shutil.disk_usage(disk_dir).free
    # Starting points: plain holds fp32 parameters, gradients and two moments on the device (16 bytes a
    # parameter) and autocast's bf16 copies of the weights (2); capstan offload keeps 14 bytes a parameter
    # of chunks in RAM in bf16 (masters, moments, the 16-bit copy, which holds the gradient), 15.5 of RSS
    # measured (the stand-in, 0.4B: docs/benchmarks.md, "GPU"); with disk, its budget (0.9 x RAM by
    # default) and the disk together hold them.
    budget = args.cpu_budget if args.cpu_budget is not None else 0.9 * ram
    starts = {"plain": 0.85 * free / (18 * per_layer), "cpu": 0.8 * ram / (16 * per_layer),
              "disk": 0.8 * (budget + disk) / (16 * per_layer)}
    on_disk = {"offload": "disk", "disk_dir": disk_dir}
    if args.cpu_budget is not None:
        on_disk["cpu_budget"] = args.cpu_budget
    systems = {"plain PyTorch": ("run_plain", {}, starts["plain"]),
               "capstan offload cpu": ("run_capstan", {"offload": "cpu"}, starts["cpu"]),
               "capstan offload disk": ("run_capstan", on_disk, starts["disk"])}
    skips = peer_skips(args.device) if args.scale_peers else {}
    if args.scale_peers:
        for name, kind in (("FSDP2 CPUOffloadPolicy", "run_fsdp"), ("DeepSpeed ZeRO-Offload", "run_deepspeed")):
            if name in skips:
                report["skipped"][f"scale: {name}"] = skips[name]
            else:
                systems[name] = (kind, {}, starts["cpu"])
    if args.scale_systems:
        keep = {SCALE_NAMES[k] for k in args.scale_systems.split(",") if k}
        systems = {n: v for n, v in systems.items() if n in keep}
    out = report["scale"] = {"d_model": d, "device": info, "ram_available": ram, "disk_free": disk, "systems": {}}
    # A lease splits the searches over its calls (CAPSTAN_SCALE_SYSTEMS) on the same warm machine: what an
    # earlier run found (--scale-earlier) for the systems not searched now stays, and counts in the ratios.
    out["systems"].update(earlier_scale(run.earlier, d, set(systems)))
    shares = {"plain PyTorch": 1.0, "FSDP2 CPUOffloadPolicy": 1.0, "DeepSpeed ZeRO-Offload": 1.0,
              "capstan offload cpu": 1.0, "capstan offload disk": 2.0}  # (disk probes move the states through the disk)
    names = list(systems)
    for i, name in enumerate(names):
        kind, memory, start = systems[name]
        weight = shares[name] / sum(shares[n] for n in names[i:])
        until = time.monotonic() + max(0.0, run.left() - 10) * weight

        why: dict[int, str] = {}

        def fits(layers: int, kind=kind, memory=memory, why=why) -> bool | None:
            cfg = _gpt_config(args, layers, d)
            cfg["train"]["steps"] = 1
            cfg["memory"] = dict(memory)
            if "disk_dir" in memory:  # each probe its own directory, removed after it (killed ones too)
                cfg["memory"]["disk_dir"] = str(Path(memory["disk_dir"]) / f"probe-{layers}")
            result = run(kind, cfg, until - time.monotonic())
            if "disk_dir" in memory:
                shutil.rmtree(cfg["memory"]["disk_dir"], ignore_errors=True)
            if "step_s" in result:
                return True
            why[layers] = result.get("error", "?")[-300:]
            # out of time (not started, or stopped at the deadline) is no answer; anything else is a failure
            return None if _cut(why[layers]) else False

        known = args.known.get(name, 0)
        found = search_largest(fits, max(1, int(start)), until, args.scale_resolution, args.scale_max_layers,
                               grow=args.scale_resolution, known=known)
        if known:
            found["known"] = known  # (fitted in an earlier lease: --scale-known)
            # ... and where nothing larger fitted here, the size reported is that lease's, not this run's
            found["from_earlier"] = found["layers"] == min(known, args.scale_max_layers)
        # A failure other than running out of memory (or time) is a defect, not a size limit: named apart
        found["failures"] = {str(n): e for n, e in why.items()}
        found["not_memory"] = sorted(n for n, e in why.items()
                                     if not e.startswith("out of memory") and not _cut(e))
        found["params"] = _params(found["layers"], d, args.vocab)
        out["systems"][name] = found
        bound = {"found": "", "none fits": "", "cap": " (the search's cap: at least this)",
                 "deadline": " (search cut short by the deadline: at least this)"}[found["end"]]
        seed = f"; {known} layers known to fit from an earlier lease" if known else ""
        print(f"  {name:24s} {found['layers']} layers of d {d}: {found['params'] / 1e9:.3f}B parameters{bound}, "
              f"fails at {found['fails_at']}; probes {found['probes']}{seed}")
        report["ratios"] = {**{k: v for k, v in report["ratios"].items() if not k.startswith("scale:")},
                            **_scale_ratios(out["systems"])}
        _write(args, report)
    for key, value in report["ratios"].items():
        if key.startswith("scale:"):
            print(f"  {key}: {value:.2f}x")


def earlier_scale(earlier: dict, d_model: int, searched: set[str]) -> dict[str, dict]:
    """The systems an earlier report (the --json file as this run found it) searched at the same d_model and
    this run does not, marked "earlier"."""
    scale = earlier.get("scale") or {}
    if scale.get("d_model") != d_model:
        return {}
    return {name: {**r, "earlier": True} for name, r in (scale.get("systems") or {}).items() if name not in searched}


def _scale_ratios(systems: dict) -> dict[str, float]:
    """capstan's largest over each peer's; a bound where a search ended at its cap or deadline."""
    capstan = {n: r for n, r in systems.items() if n.startswith("capstan")}
    if not capstan:
        return {}
    best = max(capstan.values(), key=lambda r: r["params"])
    out = {}
    for peer, target in (("plain PyTorch", 3.0), ("DeepSpeed ZeRO-Offload", 1.2), ("FSDP2 CPUOffloadPolicy", None)):
        r = systems.get(peer, {})
        if r.get("layers") and best["layers"]:
            bound = (" (at least: capstan's search ended at its " + best["end"] + ")"
                     if best["end"] in ("cap", "deadline") else "")
            bound += " (at most: the peer's search ended at its deadline)" if r["end"] == "deadline" else ""
            bound += " (a size an earlier lease measured)" if best.get("from_earlier") or r.get("from_earlier") else ""
            key = f"scale: capstan / {peer}" + (f" (target >= {target})" if target else "") + bound
            out[key] = best["params"] / r["params"]
    return out


def _write(args: argparse.Namespace, report: dict) -> None:
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, args.json)


SECTIONS = {"speed": speed, "peers": peers, "scale": scale}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "standin"))
    ap.add_argument("--sections", default="speed,peers", help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--scale", action="store_true", help="add the scale section")
    ap.add_argument("--quick", action="store_true", help="a ~0.1B GPT, few steps")
    ap.add_argument("--tiny", action="store_true", help="stand-in sizes: d 64, 2 layers, seq 32, vocab 256")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), help="default bf16 on CUDA, fp32 on the stand-in")
    ap.add_argument("--peers-d-model", type=int, help="the peers section's model (default: --d-model)")
    ap.add_argument("--peers-layers", type=int, help="the peers section's model (default: --layers)")
    ap.add_argument("--scale-d-model", type=int, default=2048)
    ap.add_argument("--scale-resolution", type=float, default=1.25, help="stop bisecting at hi / lo <= this")
    ap.add_argument("--scale-max-layers", type=int, default=4096)
    ap.add_argument("--scale-peers", action="store_true", help="FSDP2 and DeepSpeed in the scale search too")
    ap.add_argument("--scale-systems", default="",
                    help="comma-separated, of plain, cpu, disk (and fsdp, deepspeed with --scale-peers); default all")
    ap.add_argument("--scale-known", default="",
                    help="sizes an earlier lease saw fit, as plain:140,cpu:133,disk:187 (layers): each search starts "
                         "above its own instead of probing it again (docs/gpu.md, \"A lease's plan\")")
    ap.add_argument("--scale-earlier", help="an earlier run's JSON report: its scale results for the systems "
                    "this run does not search are kept (a search split over calls)")
    ap.add_argument("--disk", help="the scale section's directory for offload disk (default: under $TMPDIR)")
    ap.add_argument("--cpu-budget", type=int, help="offload disk: bytes of chunks in RAM (default: the engine's)")
    ap.add_argument("--standin-memory", type=int, default=96 << 20, help="bytes of the stand-in device")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for one measurement")
    ap.add_argument("--deadline", type=float, default=0, help="seconds for the whole run (0: none)")
    ap.add_argument("--json", help="write the report here (rewritten after every section)")
    args = ap.parse_args(argv)
    bad = set(args.scale_systems.split(",")) - {"", *SCALE_NAMES}
    if bad:
        ap.error(f"--scale-systems: unknown {sorted(bad)}; choose from plain, cpu, disk, fsdp, deepspeed")
    args.known = {}
    for item in filter(None, args.scale_known.split(",")):
        system, _, layers = item.partition(":")
        if system not in SCALE_NAMES or not layers.isdigit():
            ap.error(f"--scale-known: {item!r} is not system:layers with a system of {', '.join(SCALE_NAMES)}")
        args.known[SCALE_NAMES[system]] = int(layers)
    peers = set(args.scale_systems.split(",")) & {"fsdp", "deepspeed"}
    if peers and not args.scale_peers:
        ap.error(f"--scale-systems {','.join(sorted(peers))} needs --scale-peers")
    if args.quick:
        args.d_model, args.layers, args.seq, args.micro, args.steps = 768, 8, 512, 8, 6
    if args.tiny:
        args.d_model, args.layers, args.seq, args.micro, args.steps, args.vocab = 64, 2, 32, 2, 4, 256
        # the stand-in's RAM is this machine's: capstan's search stops at 64 layers (12.6M parameters)
        args.scale_d_model, args.cpu_budget, args.scale_max_layers = 128, 8 << 20, 64
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.peers_d_model = args.peers_d_model or args.d_model
    args.peers_layers = args.peers_layers or args.layers
    sections = [s for s in args.sections.split(",") if s] + (["scale"] if args.scale else [])
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    run = Runner(args)
    try:  # the scale section keeps what an earlier run found for the systems it does not search
        run.earlier = json.loads(Path(args.scale_earlier).read_text()) if args.scale_earlier else {}
    except (OSError, ValueError):
        run.earlier = {}
    report: dict = {"args": vars(args), "device": args.device, "sections": {}, "skipped": {}, "ratios": {}}
    for name in sections:
        t0 = time.monotonic()
        try:
            SECTIONS[name](args, run, report)
            report["sections"][name] = {"seconds": round(time.monotonic() - t0, 1)}
        except Exception as exc:  # one section's failure costs only that section
            report["sections"][name] = {"seconds": round(time.monotonic() - t0, 1), "error": repr(exc)}
            print(f"bench_gpu: section {name} failed: {exc!r}", file=sys.stderr)
        _write(args, report)
    failed = [n for n, s in report["sections"].items() if "error" in s]
    # capstan failing a measurement (not a peer, not the scale search's out-of-memory) fails the run
    failed += [f"{section}: {name}" for section in ("speed", "peers") for name, r in report.get(section, {}).items()
               if name.startswith("capstan") and "error" in r and not _cut(r["error"])]
    failed += [f"scale: {name}" for name, r in report.get("scale", {}).get("systems", {}).items()
               if name.startswith("capstan") and r.get("not_memory")]
    report["failed"] = failed
    # what the deadline cut short: the run is then incomplete, not failed (the summary says which)
    report["incomplete"] = [f"{section}: {name}" for section in ("speed", "peers")
                            for name, r in report.get(section, {}).items()
                            if "error" in r and _cut(r["error"])]
    report["incomplete"] += [f"scale: {name}" for name, r in report.get("scale", {}).get("systems", {}).items()
                             if r["end"] == "deadline"]
    # a baseline or a peer that failed (not skipped by design, not cut by the deadline): its ratio, a target's
    # other half, was never measured, which the summary must not pass over as ok
    report["unmeasured"] = [f"{section}: {name}: {r['error']}" for section in ("speed", "peers")
                            for name, r in report.get(section, {}).items()
                            if not name.startswith("capstan") and "error" in r and not _cut(r["error"])]
    _write(args, report)
    if failed:
        print(f"bench_gpu: failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
