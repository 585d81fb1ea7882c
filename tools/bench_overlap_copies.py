"""Benchmark: the overlapped optimizer's step where every guess stands, on the CPU suite's stand-in device.

    python tools/bench_overlap_copies.py                 # 134M GPT (d 768, 8 layers), offload cpu, fp32
    python tools/bench_overlap_copies.py --layers 2      # smaller

What it shows: the cost of the rollback copies a guessing step keeps (12 B a parameter with fp32 moments,
chunkmem's overlap.py). A clip no gradient reaches (grad_clip 1e9) makes every step guess and every guess
stand, as in most steps of real training; the step's wall time (median of the steps after three warm-up
steps) and its `_settle` (the main thread's end of the step) are printed as one JSON line. The stand-in
runs the device's ops on the CPU, so the figures are the host's side of the step, never a GPU's; compare
two versions of the code in alternating runs on the same machine (docs/benchmarks.md, "GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--steps", type=int, default=4, help="timed steps after 3 warm-up steps")
    args = ap.parse_args()
    os.environ.setdefault("CAPSTAN_STANDIN_DEVICES", "1")
    os.environ.setdefault("CAPSTAN_STANDIN_MEMORY", str(8 << 30))
    from capstan.native import standin

    standin.load()
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_gpu

    from capstan.chunkmem.optim import overlap
    from capstan.engine import initialize

    ns = argparse.Namespace(d_model=args.d_model, layers=args.layers, seq=32, vocab=bench_gpu.VOCAB, steps=1,
                            micro=1, device="standin", dtype="fp32")
    cfg = bench_gpu._gpt_config(ns, args.layers, args.d_model)
    cfg["memory"] = {"offload": "cpu"}
    cfg["train"]["grad_clip"] = 1e9
    engine = initialize(config=cfg)
    g = torch.Generator().manual_seed(0)

    def step() -> float:
        x = torch.randint(0, bench_gpu.VOCAB, (1, 33), generator=g)
        t0 = time.perf_counter()
        engine.train_batch(iter([(x[:, :-1], x[:, 1:])]))
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    settle: list[float] = []
    real = overlap.Speculation._settle

    def timed(self: overlap.Speculation) -> None:
        t0 = time.perf_counter()
        real(self)
        settle.append(time.perf_counter() - t0)

    overlap.Speculation._settle = timed  # type: ignore[method-assign]
    steps = [step() for _ in range(args.steps)]
    spec = engine.optimizer.speculation
    params = sum(h.slot.numel for h in engine.module.homes.values())
    engine.close()
    print(json.dumps({"params": params, "step_s": statistics.median(steps), "settle_s": statistics.median(settle),
                      "stepped_early": spec.stepped_early, "rollbacks": spec.rollbacks}))


if __name__ == "__main__":
    main()
