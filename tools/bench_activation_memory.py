"""Benchmark: activation bytes a forward keeps for backward, per rank, by layout and memory option.

Counts every tensor autograd saves during one forward of the reference GPT
(torch.autograd.graph.saved_tensors_hooks; views of one storage counted once
per save, as autograd holds them) on one micro-batch: tp = 1; tp = 2; tp = 2
with parallel.sequence_parallel; and each with memory.activation_checkpointing.
Two ranks (capstan.comm.testing.run_ranks, gloo); tp = 1 runs on rank 0 alone.
Exact byte counts, not timings: the result does not depend on the machine's load.

Usage: python tools/bench_activation_memory.py [--layers 6 --d-model 512 --heads 8 --seq 256 --micro 4]
Prints a markdown table (its section of docs/benchmarks.md).
"""

from __future__ import annotations

import argparse

LAYOUTS = [("tp=1", 1, False, False), ("tp=1 + activation_checkpointing", 1, False, True),
           ("tp=2", 2, False, False), ("tp=2 + sequence_parallel", 2, True, False),
           ("tp=2 + sequence_parallel + activation_checkpointing", 2, True, True)]


def _saved_bytes(a: dict, tp: int, sp: bool, ckpt: bool) -> int:
    from capstan import comm
    from capstan.engine import initialize, open_data, train_batches
    from capstan.engine.testing import count_saved_bytes

    cfg = {"model": {"n_layers": a["layers"], "n_heads": a["heads"], "d_model": a["d_model"], "seq_len": a["seq"]},
           "data": {"max_bytes": 2_000_000}, "train": {"micro_batch_size": a["micro"]},
           "precision": {"dtype": "fp32"},
           "parallel": {"tp": tp, "dp": 1, "sequence_parallel": sp}, "memory": {"activation_checkpointing": ckpt}}
    groups = None
    if tp == 1:  # a one-rank layout inside the 2-rank job
        groups = comm.single_process_groups()
    engine = initialize(config=cfg, groups=groups) if groups else initialize(config=cfg)
    x, y = next(train_batches(open_data(engine.config), engine.config, 1, 0))
    with count_saved_bytes() as total:
        engine((x, y))
    return total[0]


def _worker(a: dict) -> dict:
    from capstan import comm

    out = {}
    for name, tp, sp, ckpt in LAYOUTS:
        if tp == 1:
            out[name] = _saved_bytes(a, tp, sp, ckpt) if comm.world().rank == 0 else None
        else:
            out[name] = _saved_bytes(a, tp, sp, ckpt)
        comm.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4)
    a = {k.replace("-", "_"): v for k, v in vars(ap.parse_args()).items()}
    from capstan.comm.testing import run_ranks

    res = run_ranks(_worker, 2, a, timeout=900, comm_timeout=600)
    base = res[0]["tp=1"]
    print(f"Reference GPT, {a['layers']} blocks, d_model {a['d_model']}, {a['heads']} heads, seq {a['seq']}, "
          f"micro-batch {a['micro']}, fp32, one forward; bytes autograd saves for backward per rank.\n")
    print("| layout | MiB saved per rank (rank 0 / rank 1) | vs tp=1 |")
    print("|---|---|---|")
    for name, *_ in LAYOUTS:
        per = [r[name] for r in res if r[name] is not None]
        shown = " / ".join(f"{b / 2**20:.1f}" for b in per)
        print(f"| {name} | {shown} | {max(per) / base:.2f}x |")


if __name__ == "__main__":
    main()
