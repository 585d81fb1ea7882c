"""Benchmarks of capstan.native against torch and dd (not tests).

    hatch run python tools/bench_native.py [--params 100_000_000] [--io-gib 1] [--reps 5]

Prints a markdown fragment (machine, medians, ratios) for its section of docs/benchmarks.md.
Bytes per Adam param: 28 = param r/w 8 + exp_avg r/w 8 + exp_avg_sq r/w 8 + fp32 grad 4.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time

import torch

from capstan import native
from capstan.native import aio, kernels

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def median_time(fn, reps: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    st = native.status()
    return (f"{cpu}, {os.cpu_count()} cores visible, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads, capability "
            f"{torch.backends.cpu.get_cpu_capability()}), libcapstan isa {st.get('isa')}, "
            f"{st.get('threads')} threads, {platform.platform()}")


def bench_adam(n: int, reps: int) -> list[tuple[str, float]]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    rows = []
    step = [0]

    def ours():
        step[0] += 1
        kernels.adam_update(p, g, m, v, step=step[0], **HP)

    rows.append(("capstan adam_update (fp32 grads)", median_time(ours, reps)))
    for name, kw in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        q = torch.nn.Parameter(p.clone())
        q.grad = g.clone()
        opt = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01, **kw)
        rows.append((f"torch AdamW {name}", median_time(opt.step, reps)))
        del opt, q
    src = torch.empty(n * 14, dtype=torch.uint8)  # 14 B read + 14 B written = 28 B/param
    src.fill_(1)
    dst = torch.empty_like(src)
    rows.append(("capstan copy_ of 28 B/param traffic", median_time(lambda: kernels.copy_(dst, src), reps)))
    rows.append(("torch copy_ of 28 B/param traffic", median_time(lambda: dst.copy_(src), reps)))
    return rows


def bench_offload_step(n: int, reps: int) -> list[tuple[str, float]]:
    """bf16 grads in, unscale + overflow check, AdamW on fp32, bf16 params out."""
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=gen)
    g16 = (torch.randn(n, generator=gen) * 1024).to(torch.bfloat16)
    m, v, out = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    inv = 1 / 1024
    step = [0]

    def fused():
        step[0] += 1
        kernels.adam_update_and_cast(p, g16, m, v, out, step=step[0], grad_scale=inv,
                                     check_overflow=True, **HP)

    t_fused = median_time(fused, reps)
    q = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01, fused=True)

    def torch_ops():
        g = g16.float().mul_(inv)
        if not bool(torch.isfinite(g).all()):
            return
        q.grad = g
        opt.step()
        out.copy_(q.detach())

    return [("capstan fused offload step", t_fused),
            ("torch ops (float+mul, isfinite, fused AdamW, cast)", median_time(torch_ops, reps))]


def bench_casts(n: int, reps: int) -> list[tuple[str, float, int]]:
    x = torch.randn(n)
    h = torch.empty(n, dtype=torch.bfloat16)
    f = torch.empty(n)
    return [("capstan fp32->bf16", median_time(lambda: kernels.cast_(x, h), reps), 6 * n),
            ("torch fp32->bf16", median_time(lambda: h.copy_(x), reps), 6 * n),
            ("capstan bf16->fp32", median_time(lambda: kernels.cast_(h, f), reps), 6 * n),
            ("torch bf16->fp32", median_time(lambda: f.copy_(h), reps), 6 * n),
            ("capstan fp32 copy", median_time(lambda: kernels.copy_(f, x), reps), 8 * n),
            ("torch fp32 copy", median_time(lambda: f.copy_(x), reps), 8 * n)]


def bench_io(path: str, gib: int) -> list[tuple[str, float, int]]:
    total, block = gib << 30, 8 << 20
    buf = aio.aligned_empty(total)
    buf.fill_(3)
    rows = []
    with aio.AsyncFile(path, "w+") as f:
        t = time.perf_counter()
        reqs = [f.write_from(buf[o:o + block], o) for o in range(0, total, block)]
        for r in reqs:
            r.wait()
        f.fsync().wait()
        rows.append((f"capstan aio write (direct={f.direct}, 8 MiB requests)",
                     time.perf_counter() - t, total))
    with aio.AsyncFile(path, "r") as f:
        t = time.perf_counter()
        reqs = [f.read_into(buf[o:o + block], o) for o in range(0, total, block)]
        for r in reqs:
            r.wait()
        rows.append((f"capstan aio read (direct={f.direct})", time.perf_counter() - t, total))
    for name, args in (("dd write oflag=direct", [f"of={path}.dd", "if=/dev/zero", "oflag=direct",
                                                   "conv=fsync"]),
                       ("dd read iflag=direct", [f"if={path}.dd", "of=/dev/null", "iflag=direct"])):
        t = time.perf_counter()
        subprocess.run(["dd", "bs=8M", f"count={total // block}", *args], check=True,
                       capture_output=True)
        rows.append((name, time.perf_counter() - t, total))
    os.unlink(path + ".dd")
    os.unlink(path)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--io-gib", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    n = args.params
    print(f"Machine: {machine()}\n")
    print(f"### Adam step, {n / 1e6:.0f}M fp32 params (median of {args.reps})\n")
    print("| variant | s/step | Mparams/s | GB/s (28 B/param) | vs capstan |\n|---|---|---|---|---|")
    rows = bench_adam(n, args.reps)
    base = rows[0][1]
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {n / t / 1e6:.0f} | {28 * n / t / 1e9:.2f} | {t / base:.2f}x |")
    print(f"\n### Offloaded step (bf16 grads, unscale + overflow check, AdamW, bf16 out), {n / 1e6:.0f}M\n")
    print("| variant | s/step | Mparams/s | vs capstan |\n|---|---|---|---|")
    rows = bench_offload_step(n, args.reps)
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {n / t / 1e6:.0f} | {t / rows[0][1]:.2f}x |")
    print(f"\n### Casts and copies, {n / 1e6:.0f}M elements\n")
    print("| op | s | GB/s (bytes read + written) |\n|---|---|---|")
    for name, t, nbytes in bench_casts(n, args.reps):
        print(f"| {name} | {t:.4f} | {nbytes / t / 1e9:.2f} |")
    print(f"\n### Sequential file I/O, {args.io_gib} GiB in {args.dir}\n")
    print("| op | s | GB/s |\n|---|---|---|")
    for name, t, nbytes in bench_io(os.path.join(args.dir, "capstan-bench.bin"), args.io_gib):
        print(f"| {name} | {t:.2f} | {nbytes / t / 1e9:.2f} |")


if __name__ == "__main__":
    main()
