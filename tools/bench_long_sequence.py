"""The longest sequence one training step can take under a fixed RAM limit: plain PyTorch vs capstan.

    hatch run python tools/bench_long_sequence.py                      # 4 GiB, 4 layers x d 256, GPT-2 vocabulary
    hatch run python tools/bench_long_sequence.py --limit-gib 3 --ratios 16 32
    hatch run python tools/bench_long_sequence.py --smoke             # tiny: checks the machinery in a minute
    hatch run python tools/bench_long_sequence.py --only-seq 1048576 --layers 1 --d-model 32 --heads 2 --vocab 256
                                                                      # one capstan step at 1M tokens, no peers

The model is the reference GPT (`--layers`, `--d-model`, `--heads`, GPT-2's 50257-token vocabulary),
batch 1, fp32, AdamW, one step on random tokens. "Under the limit" means the peak resident memory of
the whole run (VmHWM, summed over its processes) stays at or below `--limit-gib`: every byte a
process touches counts, the interpreter, torch and the model states included, so capstan's second
rank pays for its own interpreter. (A cgroup would enforce the limit; this machine has none to
give, so the benchmark measures instead of killing.)

* **plain PyTorch**, one process: nn.Embedding + learned positions, pre-LN blocks (nn.Linear q/k/v
  fused, `F.scaled_dot_product_attention`, GeLU MLP), LayerNorm, head, `F.cross_entropy`, fused
  AdamW; and the same with `torch.utils.checkpoint` around every block (a user's standard lever).
  Each sequence length runs in a fresh interpreter; lengths double from `--start` until the peak
  passes the limit, then a bisection to `--grain` tokens finds the longest that fits.
* **capstan**, `--cp` ranks (capstan.comm.testing.run_ranks: fresh interpreters, gloo, one thread each):
  `parallel.cp` over the ranks (`--cp-mode`), ZeRO (`--zero-stage`, 2 by default: a ZeRO-3 unit of this
  model's 12.9M-parameter embedding gathered with its gradient buffers costs more than the sharded
  states save) over them, with `--cpu-budget-mib` the states in chunks on disk, `memory.tiled_loss`
  (default), `memory.mlp_tile`, `activation_checkpointing` and `activation_offload` to a disk directory
  (`--disk-dir`). It runs at `--ratios` times plain PyTorch's longest sequence (the better of the two
  peers) and reports whether each fits.

Prints a markdown table (for docs/benchmarks.md) and writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
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
    VOCAB = %d

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

        def forward(self, ids):
            x = self.wte(ids) + self.wpe[: ids.shape[1]]
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False) if ckpt else blk(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, VOCAB, (1, seq + 1))
    t0 = time.perf_counter()
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    del logits
    loss.backward()
    opt.step()
    seconds = time.perf_counter() - t0
    hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
    print(json.dumps({"loss": float(loss), "rss_peak": hwm, "seconds": seconds}))
""" % VOCAB)  # noqa: UP031 (a code template: its braces would need doubling for str.format)


def plain_step(a: argparse.Namespace, seq: int, ckpt: bool) -> dict:
    """One step of plain PyTorch at `seq` tokens in a fresh interpreter; {'rss_peak', 'seconds'} or a failure."""
    cmd = [sys.executable, "-c", PLAIN, str(a.layers), str(a.d_model), str(a.heads), str(seq), str(int(ckpt)),
           str(a.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if out.returncode != 0:  # killed for memory (the machine's own limit), or worse
        return {"rss_peak": float("inf"), "seconds": None, "error": out.stderr.strip()[-300:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def longest_plain(a: argparse.Namespace, ckpt: bool, limit: int) -> tuple[int, list[dict]]:
    """Doubling, then bisection to `grain` tokens: the longest sequence whose peak RSS fits `limit`."""
    rows, good, bad, seq = [], 0, None, a.start
    while bad is None:
        r = {"seq": seq, **plain_step(a, seq, ckpt)}
        rows.append(r)
        print(f"  plain{' +checkpoint' if ckpt else ''} seq {seq}: peak {r['rss_peak'] / GIB:.2f} GiB", flush=True)
        if r["rss_peak"] <= limit:
            good, seq = seq, seq * 2
        else:
            bad = seq
    while bad - good > a.grain:
        mid = (good + bad) // 2 // a.grain * a.grain
        if mid <= good:
            break
        r = {"seq": mid, **plain_step(a, mid, ckpt)}
        rows.append(r)
        print(f"  plain{' +checkpoint' if ckpt else ''} seq {mid}: peak {r['rss_peak'] / GIB:.2f} GiB", flush=True)
        good, bad = (mid, bad) if r["rss_peak"] <= limit else (good, mid)
    return good, rows


def capstan_config(a: argparse.Namespace, seq: int, disk: str) -> dict:
    return {"model": {"n_layers": a.layers, "n_heads": a.heads, "d_model": a.d_model, "seq_len": seq,
                      "vocab_size": a.vocab, "dropout": 0.0},
            "train": {"micro_batch_size": 1, "steps": 1, "warmup_steps": 0, "lr": 1e-3},
            "parallel": {"cp": a.cp, "cp_mode": a.cp_mode, "zero_stage": a.zero_stage},
            "memory": {"activation_checkpointing": True, "activation_offload": True, "mlp_tile": a.mlp_tile,
                       "disk_dir": disk, **({"offload": "disk", "cpu_budget": a.cpu_budget_mib << 20}
                                            if a.cpu_budget_mib else {})}}


def capstan_worker(cfg: dict, seq: int) -> dict:
    """One rank: one step on random tokens (every cp rank reads the same sequence, keeps its share)."""
    import torch

    from capstan.comm.procmem import peak_rss_bytes
    from capstan.engine import initialize

    torch.set_num_threads(1)
    engine = initialize(config=cfg)
    ids = torch.randint(0, cfg["model"]["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    info = engine.train_batch(iter([(ids[:, :-1], ids[:, 1:])]))
    seconds = time.perf_counter() - t0
    engine.close()
    return {"rss_peak": peak_rss_bytes(), "seconds": seconds, "loss": info.loss,
            "act": {k: v for k, v in info.mem.items() if k.startswith("mem.act.")}}


def capstan_step(a: argparse.Namespace, seq: int) -> dict:
    """One step of capstan at `seq` tokens on `cp` ranks (fresh interpreters); their peak RSS summed."""
    from capstan.comm.testing import run_ranks

    with tempfile.TemporaryDirectory(prefix="capstan-longseq-", dir=a.disk_dir) as tmp:
        try:
            ranks = run_ranks(capstan_worker, a.cp, capstan_config(a, seq, tmp), seq, timeout=a.timeout)
        except Exception as exc:  # noqa: BLE001 - a rank killed for memory is a result here
            return {"rss_peak": float("inf"), "seconds": None, "error": str(exc)[-500:]}
    return {"rss_peak": sum(r["rss_peak"] for r in ranks), "seconds": max(r["seconds"] for r in ranks),
            "loss": ranks[0]["loss"], "per_rank": [r["rss_peak"] for r in ranks], "act": ranks[0]["act"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit-gib", type=float, default=4.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--cp-mode", default="ulysses",
                   help="ulysses (the fused attention kernel; the faster, tools/bench_context.py) or ring")
    p.add_argument("--mlp-tile", type=int, default=4096)
    p.add_argument("--zero-stage", type=int, default=2, help="ZeRO stage over the cp ranks (the replicas)")
    p.add_argument("--cpu-budget-mib", type=int, default=0,
                   help="model states in chunks on disk with this much RAM per rank (0: in RAM)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the plain run (all the cores)")
    p.add_argument("--start", type=int, default=1024)
    p.add_argument("--grain", type=int, default=256)
    p.add_argument("--ratios", type=float, nargs="+", default=[16.0])
    p.add_argument("--disk-dir", default=None, help="where capstan's activations and run go (default: a temp dir)")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--plain-from", default=None, help="reuse the plain PyTorch search of an earlier --out file")
    p.add_argument("--vocab", type=int, default=VOCAB, help="capstan's vocabulary (the peers keep GPT-2's)")
    p.add_argument("--only-seq", type=int, nargs="+", default=None,
                   help="no peers: one capstan step at each of these sequence lengths (peak RSS, seconds, loss)")
    a = p.parse_args()
    if a.only_seq:
        return only_capstan(a)
    if a.smoke:
        a.layers, a.d_model, a.heads, a.limit_gib, a.start, a.grain, a.ratios = 2, 64, 2, 1.2, 256, 256, [4.0]
    limit = int(a.limit_gib * GIB)
    print(f"limit {a.limit_gib} GiB; model {a.layers} layers x d {a.d_model}, vocab {VOCAB}", flush=True)
    if a.plain_from:  # the peers' search from an earlier run (same limit and model)
        earlier = json.loads(Path(a.plain_from).read_text())
        plain_rows, ckpt_rows = earlier["plain"], earlier["ckpt"]
        plain = max([r["seq"] for r in plain_rows if r["rss_peak"] <= limit], default=0)
        ckpt = max([r["seq"] for r in ckpt_rows if r["rss_peak"] <= limit], default=0)
    else:
        plain, plain_rows = longest_plain(a, False, limit)
        ckpt, ckpt_rows = longest_plain(a, True, limit)
    best = max(plain, ckpt)
    unit = 2 * a.cp  # ring: 2 cp chunks (Ulysses: cp); the MLP's last tile may be short
    rows = []
    for ratio in a.ratios:
        seq = -(-int(best * ratio) // unit) * unit  # at least `ratio` times
        r = {"ratio": ratio, "seq": seq, **capstan_step(a, seq)}
        rows.append(r)
        print(f"  capstan cp {a.cp} seq {seq} ({seq / best:.1f}x): peak {r['rss_peak'] / GIB:.2f} GiB, "
              f"step {r['seconds']} s{'  ' + r.get('error', '') if 'error' in r else ''}", flush=True)
    print()
    print(f"| system | longest sequence under {a.limit_gib:g} GiB | peak RSS there | step s | vs plain PyTorch |")
    print("|---|---|---|---|---|")
    for name, seq, rs in (("plain PyTorch", plain, plain_rows), ("plain PyTorch + checkpoint", ckpt, ckpt_rows)):
        at = next((r for r in rs if r["seq"] == seq), None)
        if at:
            print(f"| {name} | {seq} | {at['rss_peak'] / GIB:.2f} GiB | {at['seconds']:.1f} | {seq / best:.2f}x |")
    for r in rows:
        fits = r["rss_peak"] <= limit
        secs = f"{r['seconds']:.1f}" if r["seconds"] else "—"
        print(f"| capstan cp {a.cp} ({a.cp_mode}), levers | {r['seq']} {'fits' if fits else 'does NOT fit'} | "
              f"{r['rss_peak'] / GIB:.2f} GiB | {secs} | {r['seq'] / best:.1f}x |")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "plain": plain_rows, "ckpt": ckpt_rows,
                                           "capstan": rows}, indent=1, default=str))
    return 0 if all(r["rss_peak"] <= limit for r in rows) else 1


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
