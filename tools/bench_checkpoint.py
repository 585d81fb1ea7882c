"""Checkpoint save and export of a model whose checkpoint is >= 10x the RAM budget: time and peak RSS.

    hatch run python tools/bench_checkpoint.py --dir /tmp/ckbench          # ~150M params, ~1.8 GB checkpoint
    hatch run python tools/bench_checkpoint.py --dir /tmp/ckbench --layers 2 --d-model 256   # smoke test

1. `capstan train` trains the reference GPT for one step with `memory.offload =
   "disk"` under `--budget` bytes of chunks in RAM and saves a checkpoint
   (fp32 parameters + Adam moments: 12 bytes per parameter, read through the
   chunk manager, so the save stays within the budget too).
2. `capstan checkpoint export` writes the consolidated safetensors file
   (streamed tensor by tensor); `capstan checkpoint inspect` verifies every
   shard's SHA-256.
3. The peer: naive consolidation as in-memory tools do it (DeepSpeed's
   zero_to_fp32 style) — every full parameter assembled into one dict in
   memory, then written with `torch.save`.

Each step is a fresh process; its peak RSS is `ru_maxrss` from `wait4`. The
target: export peak RSS <= 2 chunk sizes + 1 GiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _measure(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a command run as its own process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed ({os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}")
    return wall, usage.ru_maxrss * 1024


NAIVE = """
import sys, torch
from pathlib import Path
from capstan.engine.checkpoint import assemble, latest, piece_index, read_manifest
d = latest(sys.argv[1]); m = read_manifest(d); idx = piece_index(m)
full = {n: assemble(d, m, idx[(n, "param")], n) for n in m["params"]}
torch.save(full, sys.argv[2])
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="scratch directory (needs ~2.5x the checkpoint size)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=180 << 20, help="memory.cpu_budget in bytes")
    ap.add_argument("--chunk", type=int, default=1 << 22, help="memory.chunk_size in elements")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    capstan = [sys.executable, "-m", "capstan.engine.cli"]
    heads = max(1, args.d_model // 64)
    train = [*capstan, "train", "--config", str(REPO / "examples" / "tiny.toml"),
             "--set", f"model.n_layers={args.layers}", "--set", f"model.d_model={args.d_model}",
             "--set", f"model.n_heads={heads}", "--set", "model.seq_len=64", "--set", "train.micro_batch_size=1",
             "--set", "train.steps=1", "--set", "train.warmup_steps=0", "--set", "train.eval_every=0",
             "--set", "memory.offload=\"disk\"", "--set", f"memory.cpu_budget={args.budget}",
             "--set", f"memory.chunk_size={args.chunk}", "--set", f"memory.disk_dir=\"{work / 'chunks'}\"",
             "--set", "checkpoint.every=1", "--set", f"log.run_dir=\"{work / 'run'}\"",
             "--set", "data.max_bytes=200000"]
    mib = 1 << 20
    t_train, rss_train = _measure(train, env)
    ck = work / "run" / "checkpoints"
    ck_bytes = sum(p.stat().st_size for p in ck.rglob("*") if p.is_file())
    shutil.rmtree(work / "chunks", ignore_errors=True)
    print(f"checkpoint {ck_bytes / mib:.0f} MiB = {ck_bytes / args.budget:.1f}x the RAM budget of "
          f"{args.budget / mib:.0f} MiB; chunk {args.chunk * 4 / mib:.0f} MiB", flush=True)
    print(f"train 1 step + save   {t_train:7.1f} s   peak RSS {rss_train / mib:7.0f} MiB", flush=True)
    t_export, rss_export = _measure([*capstan, "checkpoint", "export", str(ck), str(work / "model.safetensors")], env)
    bound = 2 * args.chunk * 4 + (1 << 30)
    out_params = (work / "model.safetensors").stat().st_size / 4 / 1e6
    print(f"export (streamed)     {t_export:7.1f} s   peak RSS {rss_export / mib:7.0f} MiB   "
          f"(bound 2 chunks + 1 GiB = {bound / mib:.0f} MiB: {'met' if rss_export <= bound else 'NOT met'}; "
          f"{out_params:.1f}M parameters)", flush=True)
    t_inspect, rss_inspect = _measure([*capstan, "checkpoint", "inspect", str(ck)], env)
    print(f"inspect (sha256)      {t_inspect:7.1f} s   peak RSS {rss_inspect / mib:7.0f} MiB", flush=True)
    t_naive, rss_naive = _measure([sys.executable, "-c", NAIVE, str(ck), str(work / "naive.pt")], env)
    print(f"naive in-memory peer  {t_naive:7.1f} s   peak RSS {rss_naive / mib:7.0f} MiB   "
          f"(export uses {rss_export / rss_naive:.2f}x of it)", flush=True)


if __name__ == "__main__":
    main()
