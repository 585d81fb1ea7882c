"""Benchmark: capstan's 1F1B against torch.distributed.pipelining, and memory per schedule.

Runs on this machine's CPUs with gloo: 2 processes (2 pipeline stages), one
thread each, a small GPT (capstan.pipeline.testing_models), 8 microbatches.

1. Throughput: in ONE 2-rank job the same model (same per-layer seeds) and
   the same data go through capstan 1F1B, torch Schedule1F1B and torch
   ScheduleGPipe, round-robin for --steps rounds after --warmup rounds (so a
   busy shared machine slows all three alike). Reports tokens/s (median of
   the rounds) and capstan / torch ratios, and checks the losses agree.
2. Memory: one fresh 2-rank job per configuration (capstan GPipe, 1F1B,
   1F1B + checkpointing). Peak resident set size (getrusage ru_maxrss, the
   whole process's high-water mark, which is why every configuration gets
   fresh processes) and its rise over the RSS right after the model is built.

Usage: python tools/bench_pipeline.py [--hidden 256 --layers 6 --vocab 4096 --seq 128 --mb-size 2]
Prints a markdown fragment (its section of docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time

import torch

from capstan.comm.health.procmem import rss_bytes
from capstan.comm.testing import run_mpirun, run_ranks
from capstan.pipeline import PipelineExecutor, make_schedule, partition
from capstan.pipeline.testing_models import gpt_loss, gpt_specs

STAGES, MICROBATCHES = 2, 8


def _specs(cfg: dict):
    return gpt_specs(
        vocab=cfg["vocab"],
        hidden=cfg["hidden"],
        layers=cfg["layers"],
        heads=cfg["heads"],
        seq=cfg["seq"],
    )


def _data(cfg: dict, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (cfg["mb_size"], cfg["seq"])
    xs = [torch.randint(0, cfg["vocab"], shape, generator=g) for _ in range(MICROBATCHES)]
    ys = [torch.randint(0, cfg["vocab"], shape, generator=g) for _ in range(MICROBATCHES)]
    return xs, ys


def _rss_mib() -> float:
    return rss_bytes() / 2**20


def _throughput(cfg: dict) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from capstan import comm

    groups = comm.build_groups(comm.Topology(pp=STAGES))
    stage = groups.pp.rank
    example = torch.zeros(cfg["mb_size"], cfg["seq"], dtype=torch.long)
    plan = partition(_specs(cfg), STAGES, cfg["partition"], example=example, group=groups.pp)
    ours = PipelineExecutor(
        plan, make_schedule("1f1b", STAGES, MICROBATCHES), groups, gpt_loss, seed=0
    )

    def torch_schedule(cls):
        module = plan.build(stage, seed=0)
        pstage = PipelineStage(module, stage, STAGES, torch.device("cpu"), group=groups.pp.pg)
        return cls(pstage, n_microbatches=MICROBATCHES, loss_fn=gpt_loss), module

    theirs = {
        "torch 1F1B": torch_schedule(Schedule1F1B),
        "torch GPipe": torch_schedule(ScheduleGPipe),
    }
    xs, ys = _data(cfg, 0)
    x, y = torch.cat(xs), torch.cat(ys)
    tokens = x.numel()

    def run_ours() -> float | None:
        return ours.step(xs, ys)

    def run_theirs(name: str):
        def go() -> float | None:
            sched, module = theirs[name]
            module.zero_grad(set_to_none=True)
            if stage == 0:
                sched.step(x)
                return None
            losses: list[torch.Tensor] = []
            sched.step(target=y, losses=losses)
            return float(torch.stack(losses).mean())

        return go

    systems = {
        "capstan 1F1B": run_ours,
        "torch 1F1B": run_theirs("torch 1F1B"),
        "torch GPipe": run_theirs("torch GPipe"),
    }
    times: dict[str, list[float]] = {k: [] for k in systems}
    losses: dict[str, float | None] = {}
    names = list(systems)
    for round_ in range(cfg["warmup"] + cfg["steps"]):
        # Rotate who goes first each round so no system always follows the same one.
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            fn = systems[name]
            comm.barrier(groups.pp)
            t0 = time.perf_counter()
            losses[name] = fn()
            comm.barrier(groups.pp)
            if round_ >= cfg["warmup"]:
                times[name].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in ours.parameters())
    return {
        "times": times,
        "losses": losses,
        "tokens": tokens,
        "params": params,
        "breakdown": ours.times,
        "bounds": plan.bounds,
    }


def _memory(cfg: dict, schedule: str, checkpoint: bool) -> dict:
    from capstan import comm

    groups = comm.build_groups(comm.Topology(pp=STAGES))
    example = torch.zeros(cfg["mb_size"], cfg["seq"], dtype=torch.long)
    plan = partition(_specs(cfg), STAGES, cfg["partition"], example=example, group=groups.pp)
    ex = PipelineExecutor(
        plan,
        make_schedule(schedule, STAGES, MICROBATCHES),
        groups,
        gpt_loss,
        seed=0,
        checkpoint=checkpoint,
    )
    xs, ys = _data(cfg, 0)
    before = _rss_mib()
    for _ in range(2):
        ex.step(xs, ys)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"before": before, "peak": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument(
        "--mem-mb-size",
        type=int,
        default=8,
        help="sequences per microbatch in the memory runs (larger: activations dominate the RSS)",
    )
    ap.add_argument(
        "--mpirun",
        action="store_true",
        help="start the 2 ranks with mpirun: capstan's p2p goes through MPI (shared memory), "
        "torch.distributed.pipelining through its gloo group, ranks bound to cores",
    )
    ap.add_argument("--skip-memory", action="store_true", help="throughput only")
    ap.add_argument("--partition", default="parameters", choices=("parameters", "flops", "time", "uniform"),
                    help="how the layers are split into the 2 stages (the same boundaries for every system)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    cfg = vars(ap.parse_args())
    mem_cfg = dict(cfg, mb_size=cfg["mem_mb_size"])

    launch = run_mpirun if cfg["mpirun"] else run_ranks
    res = launch(_throughput, STAGES, cfg, timeout=1800, comm_timeout=600)
    # Every rank times the same barrier-to-barrier interval; take rank 0's.
    times, tokens = res[0]["times"], res[0]["tokens"]
    params = sum(r["params"] for r in res)
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    last = res[-1]["losses"]
    ours_name = "capstan 1F1B"

    cpu = platform.processor() or platform.machine()
    transport = ("mpirun: capstan p2p over MPI, torch pipelining over gloo" if cfg["mpirun"]
                 else "gloo for both")
    print(f"## Pipeline: capstan 1F1B vs torch.distributed.pipelining ({cpu})\n")
    model = (
        f"GPT {params / 1e6:.1f}M parameters (vocab {cfg['vocab']}, hidden {cfg['hidden']}, "
        f"{cfg['layers']} blocks, {cfg['heads']} heads, seq {cfg['seq']})"
    )
    print(
        f"{model}, {STAGES} stages ({transport}, 2 processes, 1 thread each), {MICROBATCHES} microbatches "
        f"of {cfg['mb_size']} sequences = {tokens} tokens per step; median of {cfg['steps']} "
        f"rounds after {cfg['warmup']} warm-up rounds, systems interleaved round-robin "
        f"(rotating order) in one job; torch {torch.__version__}; partition {cfg['partition']!r}: "
        f"layers {res[0]['bounds'][0]}:{res[0]['bounds'][1]} | {res[0]['bounds'][1]}:{res[0]['bounds'][2]}.\n"
    )
    cols = ["system", "step (s, median)", "tokens/s", "capstan 1F1B speed-up"]
    cols += ["paired per round (min-max)", "last-step loss"]
    print("| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")
    ours = times["capstan 1F1B"]
    for k, v in times.items():
        # Times of one round ran back to back: their ratio cancels slow drifts of machine load.
        paired = sorted(b / a for a, b in zip(ours, v, strict=True))
        row = [k, f"{statistics.median(v):.3f}", f"{tps[k]:.0f}", f"{tps[ours_name] / tps[k]:.2f}x"]
        row += [f"{statistics.median(paired):.2f}x ({paired[0]:.2f}-{paired[-1]:.2f})"]
        row += [f"{last[k]:.6f}"]
        print("| " + " | ".join(row) + " |")
    print("\ncapstan 1F1B, last round, seconds per stage (forward / backward / p2p wait / step):\n")
    for s, r in enumerate(res):
        b = r["breakdown"]
        parts = " / ".join(f"{b[k]:.3f}" for k in ("forward", "backward", "comm", "total"))
        print(f"- stage {s}: {parts}")
    if cfg["skip_memory"]:
        return
    print(
        f"\nMemory: {MICROBATCHES} microbatches of {mem_cfg['mb_size']} sequences; peak RSS = "
        f"ru_maxrss of a fresh process per configuration; the rise over the RSS after building "
        f"the stage holds the activations in flight, the gradients and allocator slack.\n"
    )
    cols = ["configuration", "stage", "microbatches in flight (peak)", "RSS after build (MiB)"]
    cols += ["peak RSS (MiB)", "rise (MiB)"]
    print("| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")
    for label, sched, ckpt in (
        ("capstan GPipe", "gpipe", False),
        ("capstan 1F1B", "1f1b", False),
        ("capstan 1F1B + checkpointing", "1f1b", True),
    ):
        mem = run_ranks(_memory, STAGES, mem_cfg, sched, ckpt, timeout=1800, comm_timeout=600)
        schedule = make_schedule(sched, STAGES, MICROBATCHES)
        for s, m in enumerate(mem):
            flight = f"{schedule.max_in_flight(s)}" + (" (inputs only)" if ckpt else "")
            print(
                f"| {label} | {s} | {flight} | {m['before']:.0f} | {m['peak']:.0f} | "
                f"{m['peak'] - m['before']:.0f} |"
            )


if __name__ == "__main__":
    main()
