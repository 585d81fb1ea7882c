"""ZeRO-3 through chunks at dp=2: `memory.chunk_size` unset (sized for the model) vs a fixed size.

Runs `capstan launch -np 2 -- capstan train` on an example config, alternating the two settings
round by round, and prints per round the chunk size used, the median step time and tokens/s
(the first steps, warm-up trace and allocation, left out), the final loss and the chunk
system's peak RAM.

    hatch run python tools/bench_chunk_size.py --config examples/tiny.toml --steps 30 --rounds 3
    hatch run python tools/bench_chunk_size.py --config examples/small.toml --steps 12 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(config: str, steps: int, chunk: int | None, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "capstan.engine.cli", "launch", "-np", "2", "--",
           "capstan", "train", "--config", config, "--set", "parallel.dp=2", "--set", "parallel.zero_stage=3",
           "--set", f"train.steps={steps}", "--set", "train.warmup_steps=2", "--set", "train.eval_every=0",
           "--set", f'log.run_dir="{run_dir}"']
    if chunk is not None:
        cmd += ["--set", f"memory.chunk_size={chunk}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    size = re.search(r"chunks of (\d+) elements", proc.stdout + proc.stderr)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = recs[2:] or recs
    return {"chunk": int(size.group(1)) if size else None,
            "step_s": statistics.median(r["step_s"] for r in steady),
            "tok_s": statistics.median(r["tokens_per_s"] for r in steady),
            "loss": recs[-1]["loss"], "peak": recs[-1]["mem.cpu.peak_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/tiny.toml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fixed", type=int, default=1 << 20, help="the fixed chunk size to compare with")
    args = ap.parse_args()
    print("| round | chunk size | median step | tokens/s | final loss | peak chunk RAM |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(1, args.rounds + 1):
            for name, chunk in (("unset", None), ("fixed", args.fixed)):
                res = run_once(args.config, args.steps, chunk, Path(tmp) / f"{name}-{r}")
                print(f"| {r} | {name}: {res['chunk']} | {res['step_s'] * 1e3:.1f} ms | {res['tok_s']:.0f} | "
                      f"{res['loss']:.4f} | {res['peak'] / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
