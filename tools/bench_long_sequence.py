"""The longest sequence one training step can take under a fixed RAM limit: plain PyTorch vs capstan.

    hatch run python tools/bench_long_sequence.py --limit-gib 1.25 --layers 4 --d-model 128 --heads 2 \
        --vocab 8192 --start 4096 --grain 2048             # the headline (docs/benchmarks.md)
    hatch run python tools/bench_long_sequence.py ... --ablation-seq 24576 --variants "cp1 all,cp1 no offload,..."
                                                          # each lever's worth at one length
    hatch run python tools/bench_long_sequence.py --smoke # tiny: checks the machinery in a few minutes
    hatch run python tools/bench_long_sequence.py --only-seq 1048576 --layers 1 --d-model 32 --heads 2 --vocab 256
                                                          # one capstan step at 1M tokens, no peers

The model is the reference GPT (`--layers`, `--d-model`, `--heads`, `--vocab` for every system), batch
1, fp32, AdamW, one step on random tokens. "Under the limit" means the peak resident memory of the
whole run (VmHWM, summed over its processes) stays at or below `--limit-gib`: every byte a process
touches counts, the interpreter, torch and the model states included, so capstan's second rank pays for
its own interpreter. (A cgroup would enforce the limit; this machine has none to give, so the benchmark
measures instead of killing.) A step past `--timeout` counts as not fitting (the search is bounded by
time too, and says so: "fails at").

* **the peers** (`--peers`), one process each, all the cores: nn.Embedding + learned positions, pre-LN
  blocks (nn.Linear q/k/v fused, `F.scaled_dot_product_attention`, GeLU MLP), LayerNorm, head,
  `F.cross_entropy`, fused AdamW: `plain`; `plain+ckpt` with `torch.utils.checkpoint` around every
  block; `plain+ckpt+chunked-ce` also with the chunked cross-entropy a PyTorch user writes in a few lines
  (the head and loss of 1024 tokens at a time, each chunk checkpointed so its logits exist only inside
  it, in forward and again in backward). The last is the peer at its best.
* **capstan** (`--variants`): `cp2 all` on two ranks (capstan.comm.testing.run_ranks: fresh interpreters,
  gloo, the cores shared out), `parallel.cp` (`--cp-mode`) with ZeRO (`--zero-stage`) over them; `cp1
  all` one process; "all" is `memory.tiled_loss`, `memory.mlp_tile`, `activation_checkpointing` and
  `activation_offload` to a disk directory (`--disk-dir`), with `--cpu-budget-mib` the states in chunks
  on disk too. The `cp1 no ...` variants leave one lever out (the ablation).

Every system's longest sequence is searched: lengths double from `--start` (capstan's from the best
peer's longest) until the peak passes the limit, then a bisection to `--grain` tokens. Prints a
markdown table (for docs/benchmarks.md) and writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_ranks workers load this file by path

GIB = 1 << 30
VOCAB = 50257

PLAIN = textwrap.dedent("""
    import json, sys, time, torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint
    torch.set_num_threads(int(sys.argv[6]))
    layers, d, heads, seq, ckpt = (int(v) for v in sys.argv[1:6])
    VOCAB, CE_CHUNK = int(sys.argv[7]), int(sys.argv[8])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
            x = x + self.o(y)
            return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Parameter(torch.zeros(seq, d))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

        def hidden(self, ids):
            x = self.wte(ids) + self.wpe[: ids.shape[1]]
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False) if ckpt else blk(x)
            return self.ln(x)

    def chunk_loss(h, t):  # one chunk's logits, freed after its loss; recomputed in backward
        return F.cross_entropy(model.head(h), t, reduction="sum")

    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, VOCAB, (1, seq + 1))
    t0 = time.perf_counter()
    h, tgt = model.hidden(ids[:, :-1])[0], ids[0, 1:]
    if CE_CHUNK:  # the chunked cross-entropy a PyTorch user writes: checkpointed chunks of the head and loss
        loss = sum(checkpoint(chunk_loss, h[i : i + CE_CHUNK], tgt[i : i + CE_CHUNK], use_reentrant=False)
                   for i in range(0, seq, CE_CHUNK)) / seq
    else:
        logits = model.head(h)
        loss = F.cross_entropy(logits, tgt)
        del logits
    loss.backward()
    opt.step()
    seconds = time.perf_counter() - t0
    hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
    print(json.dumps({"loss": float(loss), "rss_peak": hwm, "seconds": seconds}))
""")


# The peers a PyTorch user would write, from none to all of the standard levers: (checkpointed blocks,
# chunked cross-entropy tokens per chunk). `--peers` picks among them.
PEERS = {"plain": (False, 0), "plain+ckpt": (True, 0), "plain+ckpt+chunked-ce": (True, 1024)}


def plain_step(a: argparse.Namespace, seq: int, peer: str) -> dict:
    """One step of a plain PyTorch peer at `seq` tokens in a fresh interpreter; {'rss_peak', 'seconds'} or a
    failure (a step past `--timeout` is one: the search's length is bounded by time as well as memory)."""
    ckpt, ce_chunk = PEERS[peer]
    cmd = [sys.executable, "-c", PLAIN, str(a.layers), str(a.d_model), str(a.heads), str(seq), str(int(ckpt)),
           str(a.threads), str(a.vocab), str(ce_chunk)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"rss_peak": float("inf"), "seconds": None, "error": f"timed out after {a.timeout} s"}
    if out.returncode != 0:  # killed for memory (the machine's own limit), or worse
        return {"rss_peak": float("inf"), "seconds": None, "error": out.stderr.strip()[-300:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def repeated(step, repeats: int):
    """`step` run `repeats` times at each length, its peak the median (peak RSS varies by 10-20% between runs
    of the same step here: malloc's arenas and the threads' timing), every run's peak kept in "peaks"."""
    def run(seq: int) -> dict:
        rows = [step(seq) for _ in range(repeats)]
        peaks = sorted(r["rss_peak"] for r in rows)
        mid = next(r for r in rows if r["rss_peak"] == peaks[len(peaks) // 2])
        return {**mid, "peaks": [r["rss_peak"] for r in rows]} if repeats > 1 else mid
    return run


def longest(step, name: str, start: int, grain: int, limit: int, unit: int = 1) -> tuple[int, list[dict]]:
    """Doubling from `start`, then bisection to `grain` tokens (multiples of `unit`): the longest sequence
    whose step's peak RSS fits `limit`. `step(seq)` returns {'rss_peak', ...}."""
    def rnd(n: int) -> int:
        return max(unit, n // unit * unit)

    rows, good, bad, seq = [], 0, None, rnd(start)
    while bad is None:
        r = {"seq": seq, **step(seq)}
        rows.append(r)
        print(f"  {name} seq {seq}: peak {r['rss_peak'] / GIB:.2f} GiB, step {r.get('seconds')} s", flush=True)
        if r["rss_peak"] <= limit:
            good, seq = seq, rnd(seq * 2)
        else:
            bad = seq
    while bad - good > grain:
        mid = rnd((good + bad) // 2 // grain * grain)
        if mid <= good or mid >= bad:
            break
        r = {"seq": mid, **step(mid)}
        rows.append(r)
        print(f"  {name} seq {mid}: peak {r['rss_peak'] / GIB:.2f} GiB, step {r.get('seconds')} s", flush=True)
        good, bad = (mid, bad) if r["rss_peak"] <= limit else (good, mid)
    return good, rows


# capstan's variants: cp ranks and the levers left out of "all" (the ablation: what each lever buys).
# "all": tiled loss, tiled MLP, recomputed blocks, their inputs offloaded to disk.
VARIANTS = {
    "cp2 all": (2, ()),
    "cp1 all": (1, ()),
    "cp1 no offload": (1, ("activation_offload",)),
    "cp1 no tiled MLP": (1, ("mlp_tile",)),
    "cp1 whole-logit loss": (1, ("tiled_loss",)),
    "cp1 no recompute": (1, ("activation_checkpointing", "activation_offload")),
}


def capstan_config(a: argparse.Namespace, seq: int, disk: str, cp: int | None = None, without: tuple = ()) -> dict:
    cp = a.cp if cp is None else cp
    memory = {"activation_checkpointing": True, "activation_offload": True, "mlp_tile": a.mlp_tile,
              "tiled_loss": True, "disk_dir": disk,
              **({"offload": "disk", "cpu_budget": a.cpu_budget_mib << 20} if a.cpu_budget_mib else {})}
    for lever in without:
        memory[lever] = 0 if lever == "mlp_tile" else False
    return {"model": {"n_layers": a.layers, "n_heads": a.heads, "d_model": a.d_model, "seq_len": seq,
                      "vocab_size": a.vocab, "dropout": 0.0},
            "train": {"micro_batch_size": 1, "steps": 1, "warmup_steps": 0, "lr": 1e-3},
            "parallel": {"cp": cp, "cp_mode": a.cp_mode, "zero_stage": a.zero_stage if cp > 1 else 0},
            "memory": memory}


def capstan_worker(cfg: dict, seq: int, threads: int = 1) -> dict:
    """One rank: one step on random tokens (every cp rank reads the same sequence, keeps its share)."""
    import torch

    from capstan.comm.health.procmem import peak_rss_bytes
    from capstan.engine import initialize

    torch.set_num_threads(threads)
    engine = initialize(config=cfg)
    ids = torch.randint(0, cfg["model"]["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    info = engine.train_batch(iter([(ids[:, :-1], ids[:, 1:])]))
    seconds = time.perf_counter() - t0
    engine.close()
    return {"rss_peak": peak_rss_bytes(), "seconds": seconds, "loss": info.loss,
            "act": {k: v for k, v in info.mem.items() if k.startswith("mem.act.")}}


def capstan_step(a: argparse.Namespace, seq: int, cp: int | None = None, without: tuple = ()) -> dict:
    """One step of capstan at `seq` tokens on `cp` ranks (fresh interpreters); their peak RSS summed."""
    from capstan.comm.testing import run_ranks

    cp = a.cp if cp is None else cp
    with tempfile.TemporaryDirectory(prefix="capstan-longseq-", dir=a.disk_dir) as tmp:
        try:
            # the cores shared out: one rank gets all of them, as the plain peer does
            ranks = run_ranks(capstan_worker, cp, capstan_config(a, seq, tmp, cp, without), seq,
                              max(1, a.threads // cp), timeout=a.timeout, init=cp > 1)
        except Exception as exc:  # noqa: BLE001 - a rank killed for memory (or past the timeout) is a result here
            return {"rss_peak": float("inf"), "seconds": None, "error": str(exc)[-500:]}
    return {"rss_peak": sum(r["rss_peak"] for r in ranks), "seconds": max(r["seconds"] for r in ranks),
            "loss": ranks[0]["loss"], "per_rank": [r["rss_peak"] for r in ranks], "act": ranks[0]["act"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit-gib", type=float, default=4.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=VOCAB, help="every system's vocabulary (GPT-2's by default)")
    p.add_argument("--cp", type=int, default=2, help="cp ranks of --only-seq")
    p.add_argument("--cp-mode", default="ulysses",
                   help="ulysses (the fused attention kernel; the faster, tools/bench_context.py) or ring")
    p.add_argument("--mlp-tile", type=int, default=4096)
    p.add_argument("--zero-stage", type=int, default=2, help="ZeRO stage over the cp ranks (the replicas)")
    p.add_argument("--cpu-budget-mib", type=int, default=0,
                   help="model states in chunks on disk with this much RAM per rank (0: in RAM)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the plain run (all the cores)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    p.add_argument("--variants", default="cp1 all,cp2 all",
                   help=f"capstan's, comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--start", type=int, default=1024)
    p.add_argument("--grain", type=int, default=256)
    p.add_argument("--disk-dir", default=None, help="where capstan's activations and run go (default: a temp dir)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds for one step (longer: does not fit)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each probe, the median peak deciding")
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="glibc's M_MMAP_THRESHOLD for every system's processes (MALLOC_MMAP_THRESHOLD_; 0: glibc's "
                        "dynamic default). Fixed, freed large blocks go back to the OS at once: peak RSS falls by up "
                        "to half and stops varying between runs (docs/benchmarks.md)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--plain-from", default=None, help="reuse the peers' searches of an earlier --out file")
    p.add_argument("--only-seq", type=int, nargs="+", default=None,
                   help="no peers: one capstan step at each of these sequence lengths (peak RSS, seconds, loss)")
    p.add_argument("--ablation-seq", type=int, default=None,
                   help="no search: every system (--peers, --variants) once at this length, peak RSS side by side")
    a = p.parse_args()
    if a.mmap_threshold:  # inherited by every subprocess: the peers' and capstan's ranks alike
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    if a.only_seq:
        return only_capstan(a)
    if a.ablation_seq:
        return ablation(a)
    if a.smoke:
        a.layers, a.d_model, a.heads, a.vocab, a.limit_gib, a.start, a.grain = 2, 64, 2, 1024, 0.6, 1024, 1024
    limit = int(a.limit_gib * GIB)
    peers = [n.strip() for n in a.peers.split(",") if n.strip()]
    variants = [n.strip() for n in a.variants.split(",") if n.strip()]
    for name in peers + variants:
        if name not in PEERS and name not in VARIANTS:
            p.error(f"unknown system {name!r}: peers are {', '.join(PEERS)}; variants {', '.join(VARIANTS)}")
    print(f"limit {a.limit_gib} GiB; model {a.layers} layers x d {a.d_model}, {a.heads} heads, vocab {a.vocab}",
          flush=True)
    results: dict[str, tuple[int, list[dict]]] = {}
    earlier = json.loads(Path(a.plain_from).read_text())["systems"] if a.plain_from else {}
    for name in peers:
        if name in earlier:  # the peers' search from an earlier run (same limit and model)
            rows = earlier[name]["rows"]
            results[name] = (max([r["seq"] for r in rows if r["rss_peak"] <= limit], default=0), rows)
        else:
            results[name] = longest(repeated(lambda seq, n=name: plain_step(a, seq, n), a.repeats), name, a.start,
                                    a.grain, limit)
    best_peer = max(peers, key=lambda n: results[n][0]) if peers else None
    best = results[best_peer][0] if best_peer else a.start
    for name in variants:
        cp, without = VARIANTS[name]
        unit = 2 * cp  # ring: 2 cp chunks (Ulysses: cp); the MLP's last tile may be short
        results[name] = longest(repeated(lambda seq, c=cp, w=without: capstan_step(a, seq, c, w), a.repeats),
                                f"capstan {name}", max(best, a.start), a.grain, limit, unit)
    print()
    print(f"| system | longest sequence under {a.limit_gib:g} GiB | peak RSS there | step s | "
          f"vs {best_peer or 'the start'} | fails at |")
    print("|---|---|---|---|---|---|")
    for name, (seq, rows) in results.items():
        at = next((r for r in rows if r["seq"] == seq), None)
        over = min([r["seq"] for r in rows if r["rss_peak"] > limit], default=None)
        label = name if name in PEERS else f"capstan {name}"
        peak = f"{at['rss_peak'] / GIB:.2f} GiB" if at else "—"
        secs = f"{at['seconds']:.1f}" if at and at.get("seconds") else "—"
        print(f"| {label} | {seq} | {peak} | {secs} | {seq / best if best else 0:.2f}x | {over or '—'} |")
    if "cp1 all" in results:  # the ablation: what each lever is worth, as the longest sequence without it
        full = results["cp1 all"][0]
        for name in variants:
            if name.startswith("cp1 ") and name != "cp1 all" and full:
                print(f"  without {name[4:]}: {results[name][0] / full:.2f}x of cp1 all")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "best_peer": best_peer, "systems": {
            n: {"longest": seq, "rows": rows} for n, (seq, rows) in results.items()}}, indent=1, default=str))
    return 0


def ablation(a: argparse.Namespace) -> int:
    """`--ablation-seq N`: each system once at N tokens, so each lever's worth is read as the memory it saves
    at one length (a search's longest sequence mixes that with the fixed costs under the limit)."""
    seq = a.ablation_seq
    rows = {}
    for name in [n.strip() for n in a.peers.split(",") if n.strip()]:
        rows[name] = plain_step(a, seq, name)
    for name in [n.strip() for n in a.variants.split(",") if n.strip()]:
        cp, without = VARIANTS[name]
        rows[f"capstan {name}"] = capstan_step(a, seq, cp, without)
    for name, r in rows.items():
        print(f"  {name}: peak {r['rss_peak'] / GIB:.3f} GiB, step {r.get('seconds')} s {r.get('error', '')[-200:]}",
              flush=True)
    base = rows.get("capstan cp1 all", {}).get("rss_peak")
    print(f"\n| system at {seq} tokens | peak RSS | step s | vs capstan cp1 all |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        secs = f"{r['seconds']:.1f}" if r.get("seconds") else "—"
        diff = f"{(r['rss_peak'] - base) / 2**20:+.0f} MiB" if base and r["rss_peak"] != float("inf") else "—"
        print(f"| {name} | {r['rss_peak'] / GIB:.3f} GiB | {secs} | {diff} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "ablation": rows}, indent=1, default=str))
    return 0


def only_capstan(a: argparse.Namespace) -> int:
    """`--only-seq`: capstan's step at given lengths, no limit and no peers (the 1M-token step)."""
    print("| model | tokens | ranks | peak RSS (sum) | per rank | step s | loss | offloaded per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in a.only_seq:
        r = capstan_step(a, seq)
        if "error" in r:
            print(f"seq {seq}: failed: {r['error']}")
            return 1
        per = ", ".join(f"{b / GIB:.2f}" for b in r["per_rank"])
        off = r["act"].get("mem.act.offloaded_peak_bytes", 0) / 2**20
        print(f"| {a.layers} x d {a.d_model}, {a.heads} heads, vocab {a.vocab} | {seq} | cp {a.cp} ({a.cp_mode}) | "
              f"{r['rss_peak'] / GIB:.2f} GiB | {per} GiB | {r['seconds']:.1f} | {r['loss']:.4f} | {off:.0f} MiB |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
