"""Benchmarks of capstan.chunkmem against plain PyTorch, each measured in one run.

    python tools/bench_chunkmem.py overhead   # everything fits: chunked vs plain PyTorch tokens/s
    python tools/bench_chunkmem.py offload    # states 4x the RAM budget (disk tier) vs all in RAM;
                                              # bytes moved per step, Belady vs LRU
    python tools/bench_chunkmem.py scale      # largest GPT in a 4 GiB budget: plain PyTorch vs capstan

`scale` runs each size in a fresh process and reads its peak RSS (ru_maxrss):
plain PyTorch AdamW at two sizes gives bytes per parameter (the slope), from
which the largest model whose step fits in the budget follows; capstan then
trains a model `--factor` times that size for one full step (meta-device
construction, chunks between a RAM budget and the disk) and its peak RSS is
checked against the same budget. One thread per process unless --threads.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A plain GPT of standard modules (each with reset_parameters, so it builds on the meta device)."""

    def __init__(self, layers: int, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def n_params(layers: int, d: int, seq: int) -> int:
    from capstan.engine.model.reference_gpt import param_count

    return param_count(layers, d, VOCAB, seq)


def batch(step: int, bsz: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (bsz, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- trainers -------------------------------------------------------------------------------
class PlainTrainer:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


class ChunkTrainer:
    def __init__(self, model: nn.Module, budget: int | None, disk: str | None, chunk: int, eviction: str) -> None:
        from capstan.chunkmem import ChunkAdam, ChunkedModel, ChunkManager, DiskStore

        store = DiskStore(disk) if disk else None
        self.manager = ChunkManager(budget, store, eviction=eviction)
        self.model = ChunkedModel(model, self.manager, chunk_size=chunk)
        self.opt = ChunkAdam(self.model, lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.manager.begin_step()
        loss = self.model(x, y)
        self.model.backward(loss)
        self.opt.step()
        self.manager.end_step()
        return loss.item()


def timed_steps(trainer: object, steps: int, bsz: int, seq: int, start: int = 0) -> list[float]:
    out = []
    for s in range(start, start + steps):
        x, y = batch(s, bsz, seq)
        t0 = time.perf_counter()
        trainer.step(x, y)  # type: ignore[attr-defined]
        out.append(time.perf_counter() - t0)
    return out


# ---- benchmarks -----------------------------------------------------------------------------
def bench_overhead(args: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(0)
    plain = PlainTrainer(GPT(args.layers, args.d_model, args.heads, args.seq))
    torch.manual_seed(0)
    chunked = ChunkTrainer(GPT(args.layers, args.d_model, args.heads, args.seq), None, None, args.chunk, "belady")
    timed_steps(plain, 2, args.batch, args.seq)
    timed_steps(chunked, 2, args.batch, args.seq)
    tp, tc = [], []
    for r in range(args.rounds):  # alternate so drift hits both alike
        tp += timed_steps(plain, args.steps, args.batch, args.seq, 10 + r * args.steps)
        tc += timed_steps(chunked, args.steps, args.batch, args.seq, 10 + r * args.steps)
    tokens = args.batch * args.seq
    return {"bench": "overhead", "params": n_params(args.layers, args.d_model, args.seq),
            "plain_tokens_per_s": tokens / statistics.median(tp),
            "capstan_tokens_per_s": tokens / statistics.median(tc),
            "ratio": statistics.median(tp) / statistics.median(tc)}


def bench_offload(args: argparse.Namespace) -> dict[str, object]:
    params = n_params(args.layers, args.d_model, args.seq)
    states = 16 * params  # fp32 param, grad, exp_avg, exp_avg_sq
    budget = states // 4
    result: dict[str, object] = {"bench": "offload", "params": params, "state_bytes": states, "budget": budget}
    trainers = {}
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
        for name, b, disk, policy in (("in_ram", None, None, "belady"), ("disk_belady", budget, tmp + "/b", "belady"),
                                      ("disk_lru", budget, tmp + "/l", "lru")):
            torch.manual_seed(0)
            trainers[name] = ChunkTrainer(GPT(args.layers, args.d_model, args.heads, args.seq), b, disk, args.chunk,
                                          policy)
            timed_steps(trainers[name], 2, args.batch, args.seq)  # warm-up step records the trace
        times = {k: [] for k in trainers}
        moved = {k: [] for k in trainers}
        for r in range(args.rounds):
            for k, t in trainers.items():
                before = t.manager.stats()["moved_bytes"]
                times[k] += timed_steps(t, args.steps, args.batch, args.seq, 10 + r * args.steps)
                moved[k].append((t.manager.stats()["moved_bytes"] - before) / args.steps)
        tokens = args.batch * args.seq
        for k in trainers:
            result[f"{k}_tokens_per_s"] = tokens / statistics.median(times[k])
            result[f"{k}_moved_bytes_per_step"] = statistics.median(moved[k])
            result[f"{k}_peak_cpu_bytes"] = trainers[k].manager.stats()["cpu"]["peak_bytes"]
            result[f"{k}_stall_s"] = trainers[k].manager.stats()["stall_s"]
        result["disk_vs_ram"] = result["disk_belady_tokens_per_s"] / result["in_ram_tokens_per_s"]
        result["belady_vs_lru_bytes"] = (
            result["disk_belady_moved_bytes_per_step"] / result["disk_lru_moved_bytes_per_step"]
        )
        for t in trainers.values():
            t.manager.close()
    return result


def _one_step(args: argparse.Namespace) -> dict[str, object]:
    """Child process of `scale`: build, train one full step, report peak RSS."""
    torch.manual_seed(0)
    if args.mode == "torch":
        trainer: object = PlainTrainer(GPT(args.layers, args.d_model, args.heads, args.seq))
    else:
        with torch.device("meta"):
            model = GPT(args.layers, args.d_model, args.heads, args.seq)
        with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
            trainer = ChunkTrainer(model, args.budget, tmp, args.chunk, "belady")
            t0 = time.perf_counter()
            loss = trainer.step(*batch(0, args.batch, args.seq))  # type: ignore[attr-defined]
            secs = time.perf_counter() - t0
            stats = trainer.manager.stats()  # type: ignore[attr-defined]
            trainer.manager.close()  # type: ignore[attr-defined]
            return {"loss": loss, "step_s": secs, "peak_rss": peak_rss(), "cpu_peak": stats["cpu"]["peak_bytes"],
                    "moved_bytes": stats["moved_bytes"]}
    t0 = time.perf_counter()
    loss = trainer.step(*batch(0, args.batch, args.seq))  # type: ignore[attr-defined]
    return {"loss": loss, "step_s": time.perf_counter() - t0, "peak_rss": peak_rss()}


def _child(args: argparse.Namespace, mode: str, layers: int, budget: int = 0) -> dict[str, object]:
    cmd = [sys.executable, __file__, "one-step", "--mode", mode, "--layers", str(layers), "--d-model",
           str(args.d_model), "--heads", str(args.heads), "--seq", str(args.seq), "--batch", str(args.batch),
           "--chunk", str(args.chunk), "--budget", str(budget), "--disk-dir", args.disk_dir or tempfile.gettempdir(),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_scale(args: argparse.Namespace) -> dict[str, object]:
    limit = int(args.ram_gib * 2**30)
    small, large = _child(args, "torch", 2), _child(args, "torch", 6)
    per_layer = (large["peak_rss"] - small["peak_rss"]) / 4  # RSS per block of the plain trainer
    fixed = small["peak_rss"] - 2 * per_layer
    torch_layers = int((limit - fixed) // per_layer)
    torch_params = n_params(torch_layers, args.d_model, args.seq)
    check = _child(args, "torch", torch_layers)  # the predicted largest really fits
    per_block = n_params(1, args.d_model, args.seq) - n_params(0, args.d_model, args.seq)
    capstan_layers = math.ceil((args.factor * torch_params - n_params(0, args.d_model, args.seq)) / per_block)
    budget = int(limit - fixed - args.headroom_mib * 2**20)  # the rest of the RAM is for the chunk system
    cap = _child(args, "capstan", capstan_layers, budget)
    return {"bench": "scale", "ram_limit": limit, "torch_bytes_per_block": per_layer, "torch_fixed_bytes": fixed,
            "torch_largest_layers": torch_layers, "torch_largest_params": torch_params,
            "torch_largest_peak_rss": check["peak_rss"], "capstan_layers": capstan_layers,
            "capstan_params": n_params(capstan_layers, args.d_model, args.seq), "capstan_cpu_budget": budget,
            "capstan_peak_rss": cap["peak_rss"], "capstan_cpu_peak": cap["cpu_peak"], "capstan_step_s": cap["step_s"],
            "capstan_moved_bytes": cap["moved_bytes"], "capstan_loss": cap["loss"],
            "capstan_fits": cap["peak_rss"] <= limit, "torch_fits": check["peak_rss"] <= limit,
            "ratio": n_params(capstan_layers, args.d_model, args.seq) / torch_params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=["overhead", "offload", "scale", "one-step"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--chunk", type=int, default=1 << 20, help="elements per chunk")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--ram-gib", type=float, default=4.0)
    p.add_argument("--factor", type=float, default=8.0)
    p.add_argument("--headroom-mib", type=int, default=2600,
                   help="scale: RAM left outside the chunk budget (capstan's model is deeper: its activations)")
    p.add_argument("--mode", choices=["torch", "capstan"], default="torch")
    p.add_argument("--budget", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fn = {"overhead": bench_overhead, "offload": bench_offload, "scale": bench_scale, "one-step": _one_step}
    print(json.dumps(fn[args.bench](args)))


if __name__ == "__main__":
    main()
