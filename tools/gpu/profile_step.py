"""Where a capstan training step spends its time on a device: torch.profiler over a few steps.

The battery's speed point says how fast a step is against plain PyTorch; this says why. It runs the
speed point's model (bench_gpu.py --quick: a ~0.1B GPT, bf16; or the peers' ~0.9B one with --d-model 2048
--layers 16 --seq 1024 --micro 4) through capstan with each `memory.offload` asked for, warms up,
profiles `--steps` steps, and prints the operators that take the most host time (the Python and launch
overhead a GPU step hides nothing of) and the most device time, plus the step time with and without the
profiler. `--offload plain` profiles the speed point's plain PyTorch loop on the same model (bf16
autocast, fused AdamW, clip_grad_norm_; bench_gpu's `run_plain`) with its phases labelled alike, so
capstan's host time per phase and its kernel launches a step read against plain PyTorch's from the same
run (the third lease profiled capstan's 0.73x step alone: 33 ms of host time, with nothing to hold it
against). One run of a few seconds per layout; a stand-in run checks the script:

    python tools/gpu/profile_step.py --device cuda --offload plain,none,cpu
    python tools/gpu/profile_step.py --device standin --tiny     # the CPU suite's stand-in, tiny sizes

The battery runs it as its `profile` step (part 1, the speed point's model) and `profile-peers` (part 2,
the peers' model with offload cpu).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tools" / "gpu"))
# capstan from the checkout where it is not installed (the GPU machine: nothing is installed there, and the
# first lease's run of this script outside the battery died on `import capstan`); an installed one wins.
for _src in [ROOT / "native" / "src", *sorted((ROOT / "packages").glob("*/src"))]:
    if str(_src) not in sys.path:
        sys.path.append(str(_src))


def _config(args: argparse.Namespace, offload: str) -> dict:
    from bench_gpu import _gpt_config

    ns = argparse.Namespace(d_model=args.d_model, layers=args.layers, seq=args.seq, micro=args.micro,
                            steps=args.warmup + args.steps, vocab=args.vocab, dtype="bf16", device=args.device)
    cfg = _gpt_config(ns)
    # "cpu-noclip": offload cpu with a clip no gradient reaches (bench_gpu's NOCLIP row): the update guessed
    # beside backward, against "cpu", clipped at 1.0 from fresh weights: the update after backward
    offload, _, noclip = offload.partition("-")
    if offload != "none":
        cfg["memory"] = {"offload": offload}
    if noclip == "noclip":
        cfg["train"]["grad_clip"] = 1e6
    return cfg


# capstan's own phases, labelled for the profiler (a `capstan::` row each: host time inside, threads included),
# so a table says how much of a step is forward, backward, the optimizer and its parts, and transfers.
PHASES = {
    "capstan.engine.engine:Engine": ("forward", "backward", "step"),
    "capstan.chunkmem.optim.adam:ChunkAdam": ("_plain_step", "_clipped_update", "_update", "grad_norm", "_drop_grads"),
    # _join: the step's wait for the worker (the fourth lease's offload step spent 46 ms in finish outside any
    # label)
    "capstan.chunkmem.optim.overlap:Speculation": ("_join", "finish", "_roll_back", "_settle", "_write_through"),
    "capstan.chunkmem.memory.transfer:Transfers": ("to_device", "to_host"),
    "capstan.chunkmem.memory.device:DeviceTier": ("write_through", "prefetch", "land"),
}


# The optimizer's worker thread: started before the profiler, so torch's profiler records nothing of it (only
# threads it starts, and autograd's); its functions are timed by hand, wall time per step: `_measure` (a
# measuring step's norm term of a chunk), `_work` (a guess's update of a chunk group), and, inside both,
# `_landed` (the wait for the chunk's copy off the device).
WORKER = {"capstan.chunkmem.optim.overlap:Speculation": ("_work", "_measure", "_landed")}
WORKER_TIME: dict[str, list[float]] = {}  # label -> [seconds, calls]


def label_phases() -> None:
    import functools
    import importlib

    from torch.profiler import record_function

    for where, names in PHASES.items():
        module, cls = where.split(":")
        owner = getattr(importlib.import_module(module), cls)
        for name in names:
            fn = getattr(owner, name, None)
            if fn is None:
                continue

            def wrapped(*a, __fn=fn, __label=f"capstan::{cls}.{name}", **k):
                with record_function(__label):
                    return __fn(*a, **k)

            if owner.__dict__.get("__call__") is fn:  # an alias (Engine.__call__ = forward): label it too
                owner.__call__ = functools.wraps(fn)(wrapped)
            setattr(owner, name, functools.wraps(fn)(wrapped))
    for where, names in WORKER.items():
        module, cls = where.split(":")
        owner = getattr(importlib.import_module(module), cls)
        for name in names:
            raw = owner.__dict__[name]
            static = isinstance(raw, staticmethod)
            fn = raw.__func__ if static else raw

            def timed(*a, __fn=fn, __label=f"capstan::{cls}.{name}", **k):
                t0 = time.perf_counter()
                try:
                    return __fn(*a, **k)
                finally:
                    spent = WORKER_TIME.setdefault(__label, [0.0, 0])
                    spent[0] += time.perf_counter() - t0
                    spent[1] += 1

            timed = functools.wraps(fn)(timed)
            setattr(owner, name, staticmethod(timed) if static else timed)


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def profile(args: argparse.Namespace, offload: str) -> None:
    import torch
    from systems import _device_setup, _tokens, plain_model, torch_step
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    from capstan.engine import initialize

    cfg = _config(args, "none" if offload == "plain" else offload)
    device, dm = _device_setup(cfg)
    engine = None
    if offload == "plain":  # bench_gpu's run_plain step, its phases labelled as capstan's are
        model, opt = plain_model(cfg, device)
        # torch's autocast has no stand-in kernels: there the plain loop runs in fp32 (bench_gpu.py's note)
        autocast = device.type == "cuda" and cfg["precision"]["dtype"] == "bf16"

        def run(b: torch.Tensor) -> None:
            torch_step(model, opt, b[:, :-1].to(device), b[:, 1:].to(device), autocast,
                       phase=lambda name: record_function(f"plain::{name}"))
    else:
        engine = initialize(config=cfg)

        def run(b: torch.Tensor) -> None:
            engine.train_batch(iter([(b[:, :-1], b[:, 1:])]))

    batches = _tokens(cfg, args.warmup + 2 * args.steps)

    def step(b: torch.Tensor) -> float:
        dm.synchronize(device)
        t0 = time.perf_counter()
        run(b)
        dm.synchronize(device)
        return time.perf_counter() - t0

    for b in batches[:args.warmup]:
        step(b)
    plain = sorted(step(b) for b in batches[args.warmup:args.warmup + args.steps])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    WORKER_TIME.clear()
    with torch_profile(activities=activities) as prof:
        profiled = sorted(step(b) for b in batches[args.warmup + args.steps:])
    worker = {k: (v[0], v[1]) for k, v in WORKER_TIME.items()}
    what = "plain PyTorch" if engine is None else f"offload {offload}"
    chunked = "" if engine is None else f", chunked {engine.chunked}"
    if engine is not None:
        engine.close()
    print(f"\n=== {what} on {device}: step {plain[len(plain) // 2] * 1e3:.1f} ms "
          f"({profiled[len(profiled) // 2] * 1e3:.1f} ms under the profiler){chunked}")
    table = prof.key_averages()
    launches = sum(ev.count for ev in table if ev.key in LAUNCHES) / args.steps
    host = sum(ev.self_cpu_time_total for ev in table) / 1e3 / args.steps
    print(f"host time {host:.1f} ms a step (every operator's self time), {launches:g} kernel launches a step")
    prefix, who = ("plain::", "plain PyTorch") if engine is None else ("capstan::", "capstan")
    print(f"{who} phases (host time, ms per step; threads' time included):")
    for ev in sorted(table, key=lambda e: -e.cpu_time_total):
        if ev.key.startswith(prefix) and ev.cpu_time_total > 0:  # (not the device-side twin rows)
            print(f"  {ev.key:48s} {ev.cpu_time_total / 1e3 / args.steps:9.1f} ms  x{ev.count / args.steps:g}")
    if worker:
        print("the optimizer's chunk jobs, timed by hand (wall time, ms per step; on the worker thread, which the "
              "profiler's tables leave out; past RAM they run in the hooks' thread instead):")
        for key, (spent, calls) in sorted(worker.items(), key=lambda kv: -kv[1][0]):
            print(f"  {key:48s} {spent * 1e3 / args.steps:9.1f} ms  x{calls / args.steps:g}")
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    if device.type == "cuda":
        print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "standin"))
    ap.add_argument("--offload", default="plain,none,cpu",
                    help="comma-separated memory.offload values for capstan (cpu-noclip: offload cpu with a clip "
                         "that never fires), and `plain` for the plain PyTorch loop")
    ap.add_argument("--tiny", action="store_true", help="stand-in sizes")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro", type=int, default=8)
    args = ap.parse_args(argv)
    args.vocab = 50304
    if args.tiny:
        args.d_model, args.layers, args.seq, args.micro, args.vocab = 64, 2, 32, 2, 256
    if args.device == "standin":
        from capstan.native import standin

        standin.load()
    label_phases()
    for offload in args.offload.split(","):
        profile(args, offload)
        # The next layout starts from an empty device, as bench_gpu's fresh process per system does: the cpu
        # layout's device budget is read from the free memory, which blocks cached by the last one would cut.
        import gc

        import torch

        gc.collect()
        empty = getattr(torch.accelerator, "empty_cache", None)  # (torch.cuda's is the same where it lacks it)
        if torch.accelerator.is_available():
            (empty or torch.cuda.empty_cache)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
