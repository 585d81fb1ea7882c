"""Benchmark: memory.activation_checkpointing, peak memory and step time against keeping activations.

Each configuration trains in a fresh process (peak RSS is a per-process
high-water mark), alternating off/on for --rounds rounds: the reference GPT
(default: 8 blocks, d_model 512, 8 heads, seq 512, micro-batch 8, fp32,
dropout 0.1), --steps optimizer steps after one warm-up step. Reports per
configuration the median step time, the peak RSS (ru_maxrss), the RSS right
after `initialize` (model and optimizer states) and their difference (what the
step adds: activations, gradients, allocator slack), and the on/off ratios.

Usage: python tools/bench_recompute.py [--layers 8 --d-model 512 --seq 512 --batch 8 --rounds 3]
Prints a markdown fragment (its section of docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from capstan.engine import initialize, open_data, train_batches
cfg = json.loads(sys.argv[1])
engine = initialize(config=cfg)
from capstan.comm.health.procmem import rss_bytes
rss_model = rss_bytes()
it = train_batches(open_data(engine.config), engine.config, 1, 0)
engine.train_batch(it)  # warm-up
times = []
for _ in range(cfg["train"]["steps"] - 1):
    t0 = time.perf_counter()
    info = engine.train_batch(it)
    times.append(time.perf_counter() - t0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"times": times, "peak": peak, "model": rss_model, "loss": info.loss}))
"""


def _config(a: argparse.Namespace, on: bool) -> dict:
    return {"model": {"n_layers": a.layers, "n_heads": a.heads, "d_model": a.d_model, "seq_len": a.seq,
                      "dropout": 0.1},
            "data": {"max_bytes": 2_000_000},
            "train": {"steps": a.steps + 1, "micro_batch_size": a.batch, "grad_accum_steps": 1, "warmup_steps": 1},
            "precision": {"dtype": "fp32"}, "memory": {"activation_checkpointing": on}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(a.rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(_config(a, on)), str(a.threads)],
                                 capture_output=True, text=True, check=True)
            runs[on].append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = 2**20
    print(f"Reference GPT, {a.layers} blocks, d_model {a.d_model}, {a.heads} heads, seq {a.seq}, micro-batch "
          f"{a.batch}, fp32, dropout 0.1, {a.threads} threads, one process; {a.rounds} fresh processes per "
          f"setting (order alternating), {a.steps} timed steps each after one warm-up.\n")
    print("| activation_checkpointing | step (s, median) | peak RSS (MiB) | RSS after initialize (MiB) | "
          "step adds (MiB) | last loss |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for on in (False, True):
        rs = runs[on]
        step = statistics.median(t for r in rs for t in r["times"])
        peak = statistics.median(r["peak"] for r in rs) / mib
        model = statistics.median(r["model"] for r in rs) / mib
        summary[on] = (step, peak, peak - model)
        print(f"| {'on' if on else 'off'} | {step:.3f} | {peak:.0f} | {model:.0f} | {peak - model:.0f} | "
              f"{rs[-1]['loss']:.6f} |")
    (t0, p0, d0), (t1, p1, d1) = summary[False], summary[True]
    print(f"\nOn vs off: step time {t1 / t0:.2f}x, peak RSS {p1 / p0:.2f}x, memory the step adds {d1 / d0:.2f}x.")


if __name__ == "__main__":
    main()
