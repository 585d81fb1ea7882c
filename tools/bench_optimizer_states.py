"""Convergence of Adam's moments stored in fewer bits (precision.optimizer_states), not a test.

    hatch run python tools/bench_optimizer_states.py [--steps 2000] [--states fp32,bf16] [--seeds 1234,1235]

Trains the same small GPT on the default corpus once per moment format and seed, in this one process and
run: same data, schedule and layout (one process, fp32 compute, flat ZeRO-0 buffers; every layout draws
the same rounding bits, test_optimizer_states.py); train.seed changes the initialization and the batch
order. Reports, averaged over the seeds, the validation loss (held-out tokens, data.val_fraction) at the
end and the mean training loss of the last 100 steps, each format's difference from fp32 moments, and
fp32's own seed-to-seed difference (the noise a format's difference is to be read against), then the
validation curve of the first seed. Prints a markdown fragment for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time


def train(states: str, steps: int, eval_every: int, seed: int) -> dict:
    from capstan import comm
    from capstan.engine import initialize, open_data, train_batches, val_batches

    cfg = {"model": {"n_layers": 4, "n_heads": 4, "d_model": 128, "seq_len": 64},
           "train": {"steps": steps, "micro_batch_size": 16, "lr": 3e-3, "min_lr": 3e-4,
                     "warmup_steps": min(100, steps // 10), "grad_clip": 1.0, "weight_decay": 0.1, "beta2": 0.999,
                     "eval_batches": 32, "seed": seed},
           "precision": {"optimizer_states": states}}
    engine = initialize(config=cfg, groups=comm.single_process_groups())
    data = open_data(engine.config)
    it = train_batches(data, engine.config, 1, 0)
    held = val_batches(data, engine.config, 1, 0)
    losses, times, evals = [], [], []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        losses.append(engine.train_batch(it).loss)
        times.append(time.perf_counter() - t)
        if step % eval_every == 0 or step == steps:
            evals.append((step, engine.eval_batch(held)))
    engine.close()
    return {"losses": losses, "evals": evals, "step_s": statistics.median(times[10:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--states", default="fp32,bf16")
    ap.add_argument("--seeds", default="1234,1235")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = {s: [train(s, args.steps, args.eval_every, seed) for seed in seeds] for s in args.states.split(",")}

    def val(s: str) -> float:
        return statistics.fmean(r["evals"][-1][1] for r in runs[s])

    def tail(s: str) -> float:
        return statistics.fmean(statistics.fmean(r["losses"][-100:]) for r in runs[s])

    print(f"### Adam moments in fewer bits: GPT 4 x 128, seq 64, 16 sequences a step, {args.steps} steps, "
          f"mean of seeds {args.seeds}\n")
    print("| moments | val loss at the end | vs fp32 | train loss, last 100 steps | vs fp32 | s/step |")
    print("|---|---|---|---|---|---|")
    for s in runs:
        step_s = statistics.median(r["step_s"] for r in runs[s])
        dv = f"{val(s) / val('fp32') - 1:+.2%}" if "fp32" in runs else "-"
        dt = f"{tail(s) / tail('fp32') - 1:+.2%}" if "fp32" in runs else "-"
        print(f"| {s} | {val(s):.4f} | {dv} | {tail(s):.4f} | {dt} | {step_s:.4f} |")
    if "fp32" in runs and len(seeds) > 1:
        a, b = runs["fp32"][0], runs["fp32"][1]
        sv = b["evals"][-1][1] / a["evals"][-1][1] - 1
        st = statistics.fmean(b["losses"][-100:]) / statistics.fmean(a["losses"][-100:]) - 1
        print(f"| fp32, seed {seeds[1]} vs seed {seeds[0]} (noise) | | {sv:+.2%} | | {st:+.2%} | |")
    print("\n| step | " + " | ".join(f"val loss, {s} (seed {seeds[0]})" for s in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for k, (step, _) in enumerate(next(iter(runs.values()))[0]["evals"]):
        print(f"| {step} | " + " | ".join(f"{r[0]['evals'][k][1]:.4f}" for r in runs.values()) + " |")


if __name__ == "__main__":
    main()
