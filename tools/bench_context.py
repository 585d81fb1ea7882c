"""Context parallelism's speed: tokens/s per core at cp = 2 (ring and Ulysses) against one process.

    hatch run python tools/bench_context.py                       # 4 layers x d 256, 4096 tokens, 3 rounds
    hatch run python tools/bench_context.py --seq 8192 --rounds 5
    hatch run python tools/bench_context.py --smoke

The reference GPT (GPT-2's vocabulary, fp32, AdamW, batch 1, the memory levers at their defaults: tiled
loss on) trains `--steps` timed steps after `--warmup` untimed ones, on random tokens, in three
launches per round: one process with one thread, cp = 2 ring and cp = 2 Ulysses on two ranks with one
thread each (capstan.comm.testing.run_ranks: gloo; each rank a core). The order of the three rotates
by round. tokens/s = seq x steps / the slowest rank's time; per core = tokens/s / ranks. The ratio
cp 2 / one process per core is the issue's target (>= 0.9): what splitting a sequence over cores
costs in attention communication and the smaller matmuls of each half.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_ranks workers load this file by path

VOCAB = 50257


def config(a: dict, cp: int, mode: str) -> dict:
    return {"model": {"n_layers": a["layers"], "n_heads": a["heads"], "d_model": a["d_model"], "seq_len": a["seq"],
                      "vocab_size": a["vocab"], "dropout": 0.0},
            "train": {"micro_batch_size": 1, "steps": 1_000_000, "warmup_steps": 0, "lr": 1e-3,
                      "lr_schedule": "constant"},
            "parallel": {"cp": cp, "cp_mode": mode}}


def worker(a: dict, cp: int, mode: str) -> dict:
    import torch

    from capstan.engine import initialize

    torch.set_num_threads(1)
    engine = initialize(config=config(a, cp, mode))

    def batches():
        k = 0
        while True:
            ids = torch.randint(0, a["vocab"], (1, a["seq"] + 1), generator=torch.Generator().manual_seed(k))
            yield ids[:, :-1], ids[:, 1:]
            k += 1

    it = batches()
    for _ in range(a["warmup"]):
        engine.train_batch(it)
    from capstan import comm
    comm.barrier()
    t0 = time.perf_counter()
    losses = [engine.train_batch(it).loss for _ in range(a["steps"])]
    seconds = time.perf_counter() - t0
    engine.close()
    return {"seconds": seconds, "losses": losses}


def run(a: dict, cp: int, mode: str) -> tuple[float, list[float]]:
    from capstan.comm.testing import run_ranks

    ranks = run_ranks(worker, cp, a, cp, mode, timeout=3600)
    seconds = max(r["seconds"] for r in ranks)
    return a["seq"] * a["steps"] / seconds, ranks[0]["losses"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    a = {"layers": args.layers, "heads": args.heads, "d_model": args.d_model, "seq": args.seq, "vocab": args.vocab,
         "steps": args.steps, "warmup": args.warmup}
    rounds = args.rounds
    if args.smoke:
        a.update(layers=2, d_model=64, heads=4, seq=256, vocab=256, steps=2)
        rounds = 1
    systems = [("one process", 1, "ulysses"), ("cp 2 ring", 2, "ring"), ("cp 2 ulysses", 2, "ulysses")]
    got: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    first: dict[str, list[float]] = {}
    for r in range(rounds):
        order = systems[r % 3:] + systems[:r % 3]
        for name, cp, mode in order:
            tps, losses = run(a, cp, mode)
            got[name].append(tps / cp)
            first.setdefault(name, losses)
            print(f"round {r}: {name}: {tps:.0f} tokens/s ({tps / cp:.0f} per core)", flush=True)
    base = statistics.median(got["one process"])
    print(f"\n{a['layers']} layers x d {a['d_model']}, {a['heads']} heads, vocab {a['vocab']}, {a['seq']} tokens, "
          f"{a['steps']} steps x {rounds} rounds (medians)\n")
    print("| system | tokens/s per core | vs one process per core |")
    print("|---|---|---|")
    for name, _, _ in systems:
        med = statistics.median(got[name])
        print(f"| {name} | {med:.0f} | {med / base:.2f}x |")
    for name in ("cp 2 ring", "cp 2 ulysses"):  # the same trajectory, within fp32 reassociation
        diff = max(abs(x - y) / abs(y) for x, y in zip(first[name], first["one process"]))
        print(f"{name}: first-round losses within {diff:.1e} relative of one process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
