"""Benchmark one GPT block under tensor parallelism on CPU (gloo, one thread per rank).

Measures, in one run:
- step time (forward + backward) of a dense GPT block at tp=1, and of the same
  block sliced at tp=2 by `capstan.tensorpar.parallelize` and by PyTorch's
  `torch.distributed.tensor.parallel.parallelize_module` (ColwiseParallel /
  RowwiseParallel), interleaved step by step so machine noise hits both alike;
- capstan's own `ParallelBlock` (fused qkv) at tp=1 and tp=2, with and without
  sequence parallelism;
- bytes communicated per step, counted inside capstan's mappings, against
  theory: 2 all-reduces of the [b, s, d] activation forward + 2 backward
  (Megatron-LM section 3), or with sequence parallelism 4 all-gathers + 4
  reduce-scatters of the same tensor, which send the same bytes per rank with
  a ring (all-reduce = reduce-scatter + all-gather).

Run (writes the Markdown fragment and prints it):

    hatch run python tools/bench_tensorpar.py --out /tmp/tensorpar.md   (then merge into docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from capstan.comm.testing import run_ranks


class DenseBlock(nn.Module):
    """A plain pre-LN GPT block with separate q, k, v (what both slicers can handle unchanged)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, s, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(y)
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


CAPSTAN_PLAN = {"q": "column", "k": "column", "v": "column", "o": "row", "fc": "column", "proj": "row"}


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    model(x).sum().backward()
    return x.grad


def _bench_rank(cfg: dict) -> dict:
    from capstan import comm
    from capstan import tensorpar as T
    from capstan.tensorpar.testing import rel_err

    n = comm.world().size
    tp = comm.build_groups(comm.Topology(tp=n)).tp
    b, s, d, heads = cfg["batch"], cfg["seq"], cfg["d_model"], cfg["heads"]
    x = torch.randn(b, s, d, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    dense = DenseBlock(d, heads)
    rng = T.TensorParallelRNG(tp, 0)
    impls: dict[str, tuple[nn.Module, torch.Tensor]] = {}
    if n == 1:
        impls["dense"] = (dense, x)
    impls["capstan_parallelize"] = (T.parallelize(copy.deepcopy(dense), CAPSTAN_PLAN, tp), x)
    impls["capstan_block"] = (T.ParallelBlock(d, heads, tp, rng, seed=1), x)
    if n > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (n,))
        torch_plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                      "o": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}
        impls["torch_parallelize_module"] = (parallelize_module(copy.deepcopy(dense), mesh, torch_plan), x)
        impls["capstan_block_sp"] = (T.ParallelBlock(d, heads, tp, rng, seed=1, sequence_parallel=True),
                                     x.chunk(n, 1)[tp.rank].contiguous())
    out: dict = {"tp": n, "times": {k: [] for k in impls}, "bytes": {}}
    # Correctness first: both slicers must compute the dense block's input gradient.
    ref = _step(dense, x)
    for k in ("capstan_parallelize", "torch_parallelize_module"):
        if k in impls:
            out[f"dx_rel_err/{k}"] = rel_err(_step(*impls[k]), ref)
    for k, (model, inp) in impls.items():
        with T.count_comm() as c:
            _step(model, inp)
        out["bytes"][k] = {"calls": dict(c.calls), "payload": dict(c.payload_bytes), "wire": c.total_wire_bytes}
    for i in range(cfg["warmup"] + cfg["iters"]):
        for k, (model, inp) in impls.items():  # interleaved: noise from other load hits all alike
            comm.barrier(tp)
            t0 = time.perf_counter()
            _step(model, inp)
            comm.barrier(tp)
            if i >= cfg["warmup"]:
                out["times"][k].append(time.perf_counter() - t0)
    return out


def _fmt_bytes(v: float) -> str:
    return f"{v / 2**20:.2f} MiB"


def report(cfg: dict, r1: dict, r2: dict) -> str:
    b, s, d = cfg["batch"], cfg["seq"], cfg["d_model"]
    act = b * s * d * 4
    med = {f"tp1/{k}": statistics.median(v) * 1e3 for k, v in r1["times"].items()}
    med.update({f"tp2/{k}": statistics.median(v) * 1e3 for k, v in r2["times"].items()})
    lines = [
        "## Tensor parallelism (capstan.tensorpar)",
        "",
        f"One pre-LN GPT block, batch {b}, sequence {s}, d_model {d}, {cfg['heads']} heads, fp32, CPU, "
        f"gloo, 1 thread per rank, {cfg['iters']} timed steps after {cfg['warmup']} warm-up "
        f"(median, forward + backward; implementations interleaved step by step). "
        f"Machine: {platform.machine()}, torch {torch.__version__}; produced by `tools/bench_tensorpar.py`.",
        "",
        "| implementation | tp | median step (ms) |",
        "|---|---|---|",
    ]
    for k, v in med.items():
        tp_, name = k.split("/")
        lines.append(f"| {name} | {tp_[2:]} | {v:.1f} |")
    ratio = med["tp2/torch_parallelize_module"] / med["tp2/capstan_parallelize"]
    lines += [
        "",
        f"- torch `parallelize_module` / capstan `parallelize` step time at tp=2: **{ratio:.2f}x** "
        f"(>1 means capstan is faster).",
        f"- tp=2 vs tp=1 speed-up of the same dense block (capstan): "
        f"{med['tp1/dense'] / med['tp2/capstan_parallelize']:.2f}x.",
        f"- input-gradient error vs the dense block: capstan {r2['dx_rel_err/capstan_parallelize']:.1e}, "
        f"torch {r2['dx_rel_err/torch_parallelize_module']:.1e} (relative, norm-wise).",
        "",
        "Bytes per step (forward + backward, one rank, counted in capstan's mappings). Theory: 4 all-reduces "
        f"of the activation ({_fmt_bytes(act)}); a ring all-reduce sends 2(n-1)/n of it, an all-gather or "
        "reduce-scatter (n-1)/n, so 4 AG + 4 RS send the same as 4 AR.",
        "",
        "| layout (tp=2) | collectives | payload | wire per rank | theory (wire) |",
        "|---|---|---|---|---|",
    ]
    ring = 2 * (2 - 1) / 2  # all-reduce wire factor at n = 2
    params = 6 * d * 4  # 2 norms (w, b) + 2 row-parallel biases, replicated, grads all-reduced under SP
    theory = {
        # separate q, k, v: three column layers, three f's, so 3 + 1 all-reduces backward instead of 2
        "capstan_parallelize": (f"6 AR of {_fmt_bytes(act)} (separate q, k, v: 3 f's)", 6 * act * ring),
        "capstan_block": (f"4 AR of {_fmt_bytes(act)} (fused qkv)", 4 * act * ring),
        "capstan_block_sp": ("4 AG + 4 RS of the activation + 6 AR of d floats", 4 * act * ring + params * ring),
    }
    for k, (what, wire) in theory.items():
        info = r2["bytes"][k]
        calls = ", ".join(f"{v} {op}" for op, v in sorted(info["calls"].items()))
        payload = _fmt_bytes(sum(info["payload"].values()))
        lines.append(f"| {k} | {calls} | {payload} | {_fmt_bytes(info['wire'])} ({info['wire']} B) | "
                     f"{what}: {_fmt_bytes(wire)} ({int(wire)} B) |")
    lines += [
        "",
        "Notes: the tp=2 ranks share the machine's cores with each other (and with whatever else runs: load "
        f"average {os.getloadavg()[0]:.1f} at the end of this run), so speed-ups are a lower bound. "
        "torch's `parallelize_module` runs the same algorithm (same collectives, same slices) through DTensor "
        "dispatch, which is where its extra time goes. Sequence parallelism is about activation memory "
        "(norms, residuals and dropout on s/tp tokens), not speed: on CPU/gloo its all-gathers and "
        "reduce-scatters along the sequence need transposes to contiguous buffers and are slower than one "
        "all-reduce of the same bytes.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the Markdown fragment here")
    a = ap.parse_args()
    cfg = {"batch": a.batch, "seq": a.seq, "d_model": a.d_model, "heads": a.heads, "warmup": a.warmup,
           "iters": a.iters}
    r1 = run_ranks(_bench_rank, 1, cfg, timeout=600, backend="gloo")[0]
    r2 = run_ranks(_bench_rank, 2, cfg, timeout=600, backend="gloo")[0]
    text = report(cfg, r1, r2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
