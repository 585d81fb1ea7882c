"""Benchmark: capstan on one GPU against a plain PyTorch loop, FSDP2 with CPU offload and DeepSpeed.

    python tools/bench_gpu.py --quick                     # speed sections on a ~0.1B GPT (a few minutes)
    python tools/bench_gpu.py --d-model 2048 --layers 24  # the speed sections on a 1.3B GPT
    python tools/bench_gpu.py --scale                     # the largest GPT each system trains a step of

Every figure comes from the same run on the same GPU (docs/benchmarks.md says which). Each
measurement runs in a subprocess of its own, so one system's memory (or its out-of-memory error)
never touches the next. Sections:

* ``no-offload``: tokens/s of capstan (train.device = "cuda", bf16, ZeRO 0, fused AdamW on the GPU)
  over a plain loop over the same model (torch.optim.AdamW(fused=True), bf16 autocast,
  clip_grad_norm_). Target >= 0.95x.
* ``offload``: capstan with memory.offload = "cpu" (16-bit parameter chunks on the GPU, fp32 masters
  and Adam moments in RAM, the native CPU Adam) over capstan without offload on the same model.
  Target >= 0.5x. Reported with TFLOPS per GPU (6 x params x tokens/s) and the model FLOPs
  utilization against the dense bf16 matmul rate measured at start.
* ``deepspeed``: DeepSpeed ZeRO-Offload (stage 2, optimizer on the CPU, DeepSpeedCPUAdam) on the same
  model and batch, when deepspeed imports (carry its wheel in; its CPU Adam builds at first use).
  Target: capstan offload >= 1.5x.
* ``fsdp``: FSDP2 (`fully_shard` per block) with `CPUOffloadPolicy` and bf16 `MixedPrecisionPolicy`, the
  optimizer stepping on the CPU: PyTorch's own offload, on the same model and batch.
* ``scale`` (--scale): the largest GPT (d_model fixed, layers doubled then bisected) that trains
  one step: plain PyTorch (all on the GPU), FSDP2 with CPU offload, DeepSpeed ZeRO-Offload (when it
  imports) and capstan with offload cpu (and disk with --disk DIR); capstan's over each peer's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpt_config(args: argparse.Namespace, layers: int | None = None) -> dict:
    return {"model": {"n_layers": layers or args.layers, "n_heads": args.d_model // 64, "d_model": args.d_model,
                      "seq_len": args.seq, "vocab_size": 50304},
            "data": {"source": "stdlib", "max_bytes": 4_000_000},
            "train": {"steps": args.steps, "micro_batch_size": args.micro, "grad_accum_steps": 1, "lr": 1e-4,
                      "min_lr": 1e-5, "warmup_steps": 0, "grad_clip": 1.0, "device": "cuda"},
            "precision": {"dtype": "bf16"},
            "log": {"run_dir": "/tmp/capstan-bench-gpu"}}


# ---- one measurement, in a subprocess -----------------------------------------------------------------
def _tokens(cfg: dict, n: int) -> list:
    import torch

    g = torch.Generator().manual_seed(0)
    m, t = cfg["model"], cfg["train"]
    return [torch.randint(0, m["vocab_size"], (t["micro_batch_size"], m["seq_len"] + 1), generator=g)
            for _ in range(n)]


def run_capstan(cfg: dict) -> dict:
    import torch

    from capstan.engine import initialize

    torch.backends.cuda.matmul.allow_tf32 = True
    engine = initialize(config=cfg)
    batches = _tokens(cfg, cfg["train"]["steps"])
    params = sum(p.numel() for p in engine.module.parameters()) if not engine.chunked else \
        sum(h.slot.numel for h in engine.module.homes.values())
    times = []
    for b in batches:
        it = iter([(b[:, :-1], b[:, 1:])])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        info = engine.train_batch(it)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        assert info.loss == info.loss, "NaN loss"
    engine.close()
    return {"params": params, "step_s": _median(times[2:]), "peak_gpu": torch.cuda.max_memory_allocated()}


def run_plain(cfg: dict) -> dict:
    import torch

    from capstan import comm
    from capstan.engine.build import build_reference_model
    from capstan.engine.config import resolve

    torch.backends.cuda.matmul.allow_tf32 = True
    c, _ = resolve(cfg)
    model = build_reference_model(c, comm.single_process_groups()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    return _torch_loop(cfg, model, opt, autocast=True)


def _torch_loop(cfg: dict, model: object, opt: object, autocast: bool) -> dict:
    """Time a plain torch training loop (bf16 autocast or the model's own precision policy)."""
    import contextlib

    import torch

    params = sum(p.numel() for p in model.parameters())
    times = []
    for b in _tokens(cfg, cfg["train"]["steps"]):
        x, y = b[:, :-1].cuda(non_blocking=True), b[:, 1:].cuda(non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            out = model(x)
        loss = model.loss(out.float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"params": params, "step_s": _median(times[2:]), "peak_gpu": torch.cuda.max_memory_allocated()}


def run_fsdp(cfg: dict) -> dict:
    """FSDP2 (`fully_shard` per block and at the root) with `CPUOffloadPolicy`: parameters, gradients
    and optimizer states in pinned RAM, each block's parameters copied to the GPU for its compute,
    the optimizer (torch AdamW) stepping on the CPU; bf16 compute through `MixedPrecisionPolicy`."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from capstan import comm
    from capstan.engine.build import build_reference_model
    from capstan.engine.config import resolve

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29518"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", 0))
    c, _ = resolve(cfg)
    model = build_reference_model(c, comm.single_process_groups())
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=True),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    for layer in model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    result = _torch_loop(cfg, model, opt, autocast=False)  # bf16 through the MixedPrecisionPolicy
    dist.destroy_process_group()
    return result


def run_deepspeed(cfg: dict) -> dict:
    import deepspeed
    import torch

    from capstan import comm
    from capstan.engine.build import build_reference_model
    from capstan.engine.config import resolve

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    c, _ = resolve(cfg)
    model = build_reference_model(c, comm.single_process_groups())
    ds = {"train_micro_batch_size_per_gpu": cfg["train"]["micro_batch_size"], "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "contiguous_gradients": True, "overlap_comm": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    times = []
    for b in _tokens(cfg, cfg["train"]["steps"]):
        x, y = b[:, :-1].cuda(), b[:, 1:].cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model.loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"params": sum(p.numel() for p in model.parameters()), "step_s": _median(times[2:]),
            "peak_gpu": torch.cuda.max_memory_allocated()}


def matmul_rate() -> dict:
    """Dense bf16 matmul TFLOPS measured here: the denominator of the model FLOPs utilization."""
    import torch

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return {"tflops": 10 * 2 * n**3 / (time.perf_counter() - t0) / 1e12}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _child(kind: str, cfg: dict, timeout: float) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); import bench_gpu as b; "
            f"print('RESULT ' + json.dumps(b.{kind}(json.loads(sys.argv[1]))))")
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    oom = any("out of memory" in x.lower() or "outofmemory" in x.lower() for x in tail)
    return {"error": "out of memory" if oom else " | ".join(tail)}


# ---- sections -----------------------------------------------------------------------------------------
def speed(args: argparse.Namespace, report: dict) -> None:
    cfg = _gpt_config(args)
    tokens = args.micro * args.seq
    peak = _child("matmul_rate", {}, 120).get("tflops", float("nan"))
    report["matmul_tflops"] = peak
    rows = {"plain PyTorch": _child("run_plain", cfg, args.timeout),
            "capstan": _child("run_capstan", cfg, args.timeout),
            "capstan offload cpu": _child("run_capstan", {**cfg, "memory": {"offload": "cpu"}}, args.timeout)}
    rows["FSDP2 CPUOffloadPolicy"] = _child("run_fsdp", cfg, args.timeout)
    if _has_deepspeed():
        rows["DeepSpeed ZeRO-Offload"] = _child("run_deepspeed", cfg, args.timeout)
    for name, r in rows.items():
        if "step_s" in r:
            r["tokens_per_s"] = tokens / r["step_s"]
            r["tflops"] = 6 * r["params"] * tokens / r["step_s"] / 1e12
            r["mfu"] = r["tflops"] / peak
    report["speed"] = rows
    print(f"GPT {rows['capstan'].get('params', 0) / 1e6:.0f}M, micro-batch {args.micro} x {args.seq} tokens, "
          f"bf16; dense bf16 matmul {peak:.0f} TFLOPS")
    for name, r in rows.items():
        if "error" in r:
            print(f"  {name:24s} {r['error']}")
        else:
            print(f"  {name:24s} {r['step_s'] * 1e3:8.1f} ms/step {r['tokens_per_s']:10.0f} tok/s "
                  f"{r['tflops']:6.1f} TFLOPS (MFU {r['mfu']:.2f}) peak GPU {r['peak_gpu'] / 2**30:.1f} GiB")

    def ratio(a: str, b: str) -> float | None:
        ra, rb = rows.get(a, {}), rows.get(b, {})
        return rb["step_s"] / ra["step_s"] if "step_s" in ra and "step_s" in rb else None

    report["ratios"] = {"capstan / plain (target >= 0.95)": ratio("capstan", "plain PyTorch"),
                        "capstan offload / capstan (target >= 0.5)": ratio("capstan offload cpu", "capstan"),
                        "capstan offload / DeepSpeed ZeRO-Offload (target >= 1.5)":
                            ratio("capstan offload cpu", "DeepSpeed ZeRO-Offload"),
                        "capstan offload / FSDP2 CPUOffloadPolicy": ratio("capstan offload cpu",
                                                                          "FSDP2 CPUOffloadPolicy")}
    for name, value in report["ratios"].items():
        print(f"  {name}: {'n/a' if value is None else f'{value:.2f}x'}")


def scale(args: argparse.Namespace, report: dict) -> None:
    systems = {"plain PyTorch": ("run_plain", {}), "FSDP2 CPUOffloadPolicy": ("run_fsdp", {}),
               "capstan offload cpu": ("run_capstan", {"offload": "cpu"})}
    if _has_deepspeed():
        systems["DeepSpeed ZeRO-Offload"] = ("run_deepspeed", {})
    if args.disk:
        systems["capstan offload disk"] = ("run_capstan", {"offload": "disk", "disk_dir": args.disk,
                                                           "cpu_budget": args.cpu_budget})
    out = {}
    for name, (kind, memory) in systems.items():
        def fits(layers: int) -> bool:
            cfg = _gpt_config(args, layers)
            cfg["train"]["steps"] = 1
            cfg["memory"] = memory
            return "step_s" in _child(kind, cfg, args.timeout)

        lo, hi = 0, 1
        while fits(hi):  # doubling, then bisection: the largest layer count that trains a step
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        d = args.d_model
        out[name] = {"layers": lo, "params": lo * 12 * d * d + 2 * 50304 * d}
        print(f"  {name:24s} {lo} layers of d {d}: {out[name]['params'] / 1e9:.2f}B parameters")
    report["scale"] = out
    best = max((r["params"] for n, r in out.items() if n.startswith("capstan")), default=0)
    for peer, target in (("plain PyTorch", 3.0), ("DeepSpeed ZeRO-Offload", 1.2), ("FSDP2 CPUOffloadPolicy", None)):
        if out.get(peer, {}).get("params"):
            ratio = best / out[peer]["params"]
            report.setdefault("scale_ratios", {})[f"capstan / {peer}"] = ratio
            print(f"  capstan / {peer}: {ratio:.2f}x" + (f" (target >= {target})" if target else ""))


def _has_deepspeed() -> bool:
    from importlib.util import find_spec

    return find_spec("deepspeed") is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a ~0.1B GPT, few steps (the setup script's run)")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--scale", action="store_true", help="search the largest GPT each system trains")
    ap.add_argument("--disk", help="with --scale: also capstan offload disk in this directory")
    ap.add_argument("--cpu-budget", type=int, default=64 << 30, help="with --disk: bytes of chunks in RAM")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.layers, args.seq, args.micro, args.steps = 768, 8, 512, 8, 6
    report: dict = {"args": vars(args)}
    speed(args, report)
    if args.scale:
        scale(args, report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
