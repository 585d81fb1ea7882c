"""Draw the chunk system's memory per tier over the moments of one training step, as PNG.

    hatch run python tools/plot_memory.py --out docs/img/memory.png [--budget-mib 8] [--eviction belady]

Trains the GPT of tools/bench_chunkmem.py for a few steps with a RAM budget
and the disk tier, recording at every moment (chunk access) of the last step
the bytes resident in RAM (the cpu tier, budget drawn as a line) and on disk,
and draws both. The numbers come from the manager's own accounting.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import torch


def _bench_module():  # noqa: ANN202 - the benchmark script is not a package; load it by path
    path = Path(__file__).with_name("bench_chunkmem.py")
    spec = importlib.util.spec_from_file_location("bench_chunkmem", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="memory.png")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--chunk", type=int, default=262144, help="elements per chunk")
    p.add_argument("--budget-mib", type=float, default=12.0)
    p.add_argument("--eviction", default="belady", choices=["belady", "lru"])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bench = _bench_module()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    budget = int(args.budget_mib * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = bench.ChunkTrainer(bench.GPT(args.layers, args.d_model, 8, 128), budget, tmp, args.chunk,
                                     args.eviction)
        trainer.manager.record_disk_timeline = True
        for s in range(args.steps):
            trainer.step(*bench.batch(s, 4, 128))
        mgr = trainer.manager
        stats = mgr.stats()
        # end_step cleared nothing: the timelines hold the last step's moments.
        cpu, disk = mgr.cpu.stats.timeline, mgr.disk_tier.stats.timeline
        mgr.close()
    fig, ax = plt.subplots(figsize=(9, 4))
    mib = 2**20
    ax.plot([c / mib for c in cpu], label="RAM (cpu tier)", color="tab:blue")
    ax.plot([d / mib for d in disk], label="disk tier", color="tab:orange")
    ax.axhline(budget / mib, color="tab:red", linestyle="--", label=f"RAM budget {args.budget_mib:g} MiB")
    ax.set_xlabel("moment (chunk access) in one training step")
    ax.set_ylabel("MiB")
    ax.set_title(f"chunk memory per tier, {args.eviction}: moved {stats['moved_bytes'] / mib:.0f} MiB "
                 f"over {args.steps} steps")
    ax.legend(loc="center right")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {len(cpu)} moments, cpu peak {max(cpu) / mib:.1f} MiB of {budget / mib:.1f}")


if __name__ == "__main__":
    main()
