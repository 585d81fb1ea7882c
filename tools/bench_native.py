"""Benchmarks of capstan.native against torch and dd (not tests).

    hatch run python tools/bench_native.py [--params 100_000_000] [--io-gib 1] [--reps 5]
        [--overlap-gib 2] [--deepspeed-python /tmp/dsvenv2/bin/python]

--deepspeed-python runs DeepSpeedCPUAdam in that interpreter (a separate venv with
deepspeed; never the workspace env) as a child process, stepping it interleaved
with capstan's CPUAdam on the same number of params. --overlap-gib times a torch
matmul loop alone and while capstan aio writes then reads that many GiB with 8
requests in flight, and while dd does the same with direct I/O (0 skips it).

Prints a markdown fragment (machine, medians, ratios) for its section of docs/benchmarks.md.
Bytes per Adam param: 28 = param r/w 8 + exp_avg r/w 8 + exp_avg_sq r/w 8 + fp32 grad 4.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import threading
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


def interleaved(fns: list[tuple[str, object]], reps: int) -> list[tuple[str, float]]:
    """Median seconds of each fn, one call of every fn per round (the machine is noisy)."""
    for _, fn in fns:
        fn()  # warm-up: page faults, thread pool start, optimizer state
    times: dict[str, list[float]] = {name: [] for name, _ in fns}
    for _ in range(reps):
        for name, fn in fns:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return [(name, statistics.median(times[name])) for name, _ in fns]


def bench_adam(n: int, reps: int) -> list[tuple[str, float]]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]

    def ours():
        step[0] += 1
        kernels.adam_update(p, g, m, v, step=step[0], **HP)

    fns = [("capstan adam_update (fp32 grads)", ours)]
    for name, kw in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        q = torch.nn.Parameter(p.clone())
        q.grad = g.clone()
        opt = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01, **kw)
        fns.append((f"torch AdamW {name}", opt.step))
    src = torch.empty(n * 14, dtype=torch.uint8)  # 14 B read + 14 B written = 28 B/param
    src.fill_(1)
    dst = torch.empty_like(src)
    fns.append(("capstan copy_ of 28 B/param traffic", lambda: kernels.copy_(dst, src)))
    fns.append(("torch copy_ of 28 B/param traffic", lambda: dst.copy_(src)))
    return interleaved(fns, reps)


def _peer_8bit(n: int, g: torch.Tensor) -> list[tuple[str, object]]:
    """The published 8-bit AdamWs that install and run on this CPU, at their defaults (block-wise, 256
    values per block), each over its own n-element parameter with the same gradient values."""
    peers = []
    try:
        import bitsandbytes as bnb  # noqa: PLC0415 (an optional peer)
        peers.append(("bitsandbytes AdamW8bit", lambda ps: bnb.optim.AdamW8bit(ps, lr=HP["lr"],
                                                                               weight_decay=HP["weight_decay"])))
    except Exception as exc:  # noqa: BLE001 (a missing or broken peer is reported, not fatal)
        print(f"(bitsandbytes not run: {type(exc).__name__}: {exc})")
    try:
        from torchao.optim import AdamW8bit  # noqa: PLC0415 (an optional peer)
        peers.append(("torchao AdamW8bit", lambda ps: AdamW8bit(ps, lr=HP["lr"], weight_decay=HP["weight_decay"])))
    except Exception as exc:  # noqa: BLE001
        print(f"(torchao not run: {type(exc).__name__}: {exc})")
    fns = []
    for name, make in peers:
        param = torch.nn.Parameter(torch.randn(n))
        param.grad = g.clone()
        opt = make([param])
        opt.step()  # state, and torchao's compile, before the timed rounds
        fns.append((f"{name} (peer, its defaults)", opt.step))
    return fns


def bench_moments(n: int, reps: int, peers: bool = False) -> list[tuple[str, float, int]]:
    """capstan's AdamW with fp32, bf16 (stochastic rounding) and 8-bit block-wise moments, interleaved
    with copies of the bytes each touches: fp32 moments 28 B/param (param, exp_avg, exp_avg_sq read and
    written, fp32 grad read), bf16 moments 20 B/param (the moments 2 + 2 each way), 8-bit moments
    16 B/param (1 + 1 each way; the fp32 scales, 8 B per 256 values, round to nothing); with a bf16
    master (stochastic rounding, no fp32 copy) the parameter's 4 + 4 become 2 + 2: bf16 moments 16 B/param,
    8-bit ones 12 B/param. With `peers`,
    bitsandbytes' and torchao's 8-bit AdamW on their own tensors of the same size in the same rounds.
    Returns (name, s, bytes)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    m32, v32 = torch.zeros(n), torch.zeros(n)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    m8, v8 = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    blocks = kernels.q8_blocks([n], 256)
    sm, sv = torch.zeros(blocks), torch.zeros(blocks)
    p16 = p.to(torch.bfloat16)  # a bf16 master (its moments share the fp32 master's: the same bytes)
    step = [0]

    def adam(m: torch.Tensor, v: torch.Tensor, param: torch.Tensor = p):
        def run() -> None:
            step[0] += 1
            kernels.adam_update(param, g, m, v, step=step[0], seed=step[0], **HP)
        return run

    def adam_q8(param: torch.Tensor = p):
        def run() -> None:
            step[0] += 1
            kernels.adam_update_q8(param, g, m8, v8, sm, sv, step=step[0], seed=step[0], **HP)
        return run

    copies = {}
    for nbytes in (28, 20, 16, 12):
        src = torch.empty(n * nbytes // 2, dtype=torch.uint8)
        src.fill_(1)
        copies[nbytes] = (src, torch.empty_like(src))
    fns = [("capstan adam_update, fp32 moments", adam(m32, v32), 28),
           ("capstan adam_update, bf16 moments (stochastic rounding)", adam(m16, v16), 20),
           ("capstan adam_update_q8, 8-bit moments (block 256, stochastic rounding)", adam_q8(), 16),
           ("capstan adam_update, bf16 master and moments (stochastic rounding)", adam(m16, v16, p16), 16),
           ("capstan adam_update_q8, bf16 master, 8-bit moments", adam_q8(p16), 12)]
    fns += [(f"capstan copy_ of {nb} B/param", (lambda c=copies[nb]: kernels.copy_(c[1], c[0])), nb)
            for nb in (28, 20, 16, 12)]
    if peers:
        fns += [(name, fn, 16) for name, fn in _peer_8bit(n, g)]
    times = interleaved([(name, fn) for name, fn, _ in fns], reps)
    return [(name, t, nb * n) for (name, t), (_, _, nb) in zip(times, fns, strict=True)]


def bench_adam_shared(n: int, reps: int) -> list[tuple[str, float]]:
    """capstan's AdamW and torch's fused AdamW stepping the *same* tensors, alternately.

    For sizes where each optimizer cannot have its own copy (1B parameters: p,
    g, m, v are 16 GB). Both update p, m, v in place from g, so the bytes moved
    per step are the same. The bandwidth reference is a copy of half the
    gradient buffer onto its other half (n*2 B read + n*2 B written), in the
    same rounds: a copy of 28 B/param would need 28 GB more.
    """
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).mul_(1e-3)
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]
    step_t = torch.zeros(())

    def ours():
        step[0] += 1
        kernels.adam_update(p, g, m, v, step=step[0], **HP)

    def torch_fused():
        step_t.add_(1)
        torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=HP["lr"], beta1=HP["beta1"],
                            beta2=HP["beta2"], weight_decay=HP["weight_decay"], eps=HP["eps"],
                            amsgrad=False, maximize=False)

    half = n // 2
    fns = [("capstan adam_update (fp32 grads)", ours), ("torch fused AdamW (_fused_adamw_)", torch_fused),
           ("capstan copy_ of half the gradient (8 B/2 params)", lambda: kernels.copy_(g[half:2 * half], g[:half]))]
    return interleaved(fns, reps)


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
    """Every op once per round, rounds interleaved (the machine is noisy); medians."""
    x = torch.randn(n)
    h = torch.empty(n, dtype=torch.bfloat16)
    hf = torch.empty(n, dtype=torch.float16)
    f = torch.empty(n)
    ops = [("capstan fp32->bf16", lambda: kernels.cast_(x, h), 6 * n),
           ("torch fp32->bf16", lambda: h.copy_(x), 6 * n),
           ("capstan bf16->fp32", lambda: kernels.cast_(h, f), 6 * n),
           ("torch bf16->fp32", lambda: f.copy_(h), 6 * n),
           ("capstan fp32->fp16", lambda: kernels.cast_(x, hf), 6 * n),
           ("torch fp32->fp16", lambda: hf.copy_(x), 6 * n),
           ("capstan fp16->fp32", lambda: kernels.cast_(hf, f), 6 * n),
           ("torch fp16->fp32", lambda: f.copy_(hf), 6 * n),
           ("capstan fp32 copy", lambda: kernels.copy_(f, x), 8 * n),
           ("torch fp32 copy", lambda: f.copy_(x), 8 * n)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in ops}
    for _, fn, _ in ops:
        fn()  # warm-up: page faults, thread pool start
    for _ in range(reps):
        for name, fn, _ in ops:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return [(name, statistics.median(times[name]), nbytes) for name, _, nbytes in ops]


def bench_io(path: str, gib: int, rounds: int = 3) -> list[tuple[str, float, int]]:
    """capstan aio vs dd, direct I/O, sequential write then read; median of interleaved rounds.

    Rounds, not one pass each: reads of the VM's virtual disk swing by 2x from
    one pass to the next (the host caches too), so single passes decided the ratio.
    """
    total, block = gib << 30, 8 << 20
    buf = aio.aligned_empty(total)
    buf.fill_(3)
    times: dict[str, list[float]] = {}

    def capstan_write() -> None:
        with aio.AsyncFile(path, "w+") as f:
            reqs = [f.write_from(buf[o:o + block], o) for o in range(0, total, block)]
            for r in reqs:
                r.wait()
            f.fsync().wait()

    def capstan_read() -> None:
        with aio.AsyncFile(path, "r") as f:
            reqs = [f.read_into(buf[o:o + block], o) for o in range(0, total, block)]
            for r in reqs:
                r.wait()

    def dd(*args: str):
        return lambda: subprocess.run(["dd", "bs=8M", f"count={total // block}", *args], check=True,
                                      capture_output=True)

    ops = [("capstan aio write (direct, 8 MiB requests, all in flight)", capstan_write),
           ("capstan aio read (direct)", capstan_read),
           ("dd write oflag=direct", dd(f"of={path}.dd", "if=/dev/zero", "oflag=direct", "conv=fsync")),
           ("dd read iflag=direct", dd(f"if={path}.dd", "of=/dev/null", "iflag=direct"))]
    for _ in range(rounds):
        for name, fn in ops:
            t = time.perf_counter()
            fn()
            times.setdefault(name, []).append(time.perf_counter() - t)
    os.unlink(path + ".dd")
    os.unlink(path)
    return [(name, statistics.median(times[name]), total) for name, _ in ops]


# Child-process side of --deepspeed-python: builds the same problem, then steps
# DeepSpeedCPUAdam once per "step" line on stdin and answers with the seconds.
_DS_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from deepspeed.ops.adam import DeepSpeedCPUAdam
n = int(sys.argv[1])
gen = torch.Generator().manual_seed(0)
p = torch.nn.Parameter(torch.randn(n, generator=gen))
p.grad = torch.randn(n, generator=gen) * 1e-3
opt = DeepSpeedCPUAdam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                       adamw_mode=True)
opt.step()  # warm-up: state allocation, page faults
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    opt.step()
    print(json.dumps({"s": time.perf_counter() - t}), flush=True)
"""


def bench_vs_deepspeed(n: int, reps: int, ds_python: str) -> list[tuple[str, float]]:
    """capstan CPUAdam vs DeepSpeedCPUAdam (AdamW, fp32 grads), steps interleaved."""
    from capstan.native.optim import CPUAdam
    # deepspeed JIT-builds cpu_adam into TORCH_EXTENSIONS_DIR; the default
    # (~/.cache/torch_extensions) is shared with any other deepspeed/torch install
    # on the machine, which makes each rebuild it, so keep it inside that venv.
    venv = os.path.dirname(os.path.dirname(os.path.abspath(ds_python)))
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()),
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                   os.path.join(venv, "torch_extensions")))
    child = subprocess.Popen([ds_python, "-c", _DS_CHILD, str(n), str(torch.get_num_threads())],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                             cwd=tempfile.gettempdir())
    try:
        for line in child.stdout:  # skip deepspeed's log lines until ready
            if line.startswith("{"):
                break
        else:
            raise RuntimeError(f"deepspeed child exited with {child.wait()}")
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(n, generator=gen))
        p.grad = torch.randn(n, generator=gen) * 1e-3
        opt = CPUAdam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                      adamw_mode=True)
        opt.step()
        ours, theirs = [], []
        for _ in range(reps):
            t = time.perf_counter()
            opt.step()
            ours.append(time.perf_counter() - t)
            child.stdin.write("step\n")
            child.stdin.flush()
            theirs.append(json.loads(child.stdout.readline())["s"])
    finally:
        child.stdin.close()
        child.wait()
    return [("capstan CPUAdam.step", statistics.median(ours)),
            ("DeepSpeedCPUAdam.step", statistics.median(theirs))]


def _sequential_io(path: str, total: int, inflight: int, block: int = 8 << 20) -> None:
    """Write then read `total` bytes sequentially, at most `inflight` requests queued (the loop
    `capstan bench-disk` measures with)."""
    from capstan.engine.machine.disk_bench import stream_file

    buf = aio.aligned_empty(inflight * block)
    buf.fill_(5)
    for mode in ("w+", "r"):
        with aio.AsyncFile(path, mode) as f:
            stream_file(f, buf, total, block, inflight, write=mode == "w+")
    os.unlink(path)


def _dd_io(path: str, total: int, block: int = 8 << 20) -> None:
    """The peer: dd writes then reads `total` bytes with direct I/O, one request at a time."""
    for args in ([f"of={path}", "if=/dev/zero", "oflag=direct", "conv=fsync"],
                 [f"if={path}", "of=/dev/null", "iflag=direct"]):
        subprocess.run(["dd", "bs=8M", f"count={total // block}", *args], check=True,
                       capture_output=True)
    os.unlink(path)


def bench_overlap(path: str, gib: int, rounds: int = 5) -> list[tuple[str, float]]:
    """torch matmul throughput alone vs while aio streams `gib` GiB (8 in flight), and while dd does.

    Each round runs the matmul loop while a thread sleeps (alone), then while a
    thread does capstan's I/O, then while a thread runs dd over the same bytes,
    each for as long as that I/O takes; the per-round ratios are the figures
    (the shared machine's load drifts between rounds). dd is the peer: the part
    of the slowdown that any direct I/O on this machine causes (on a VM, the
    hypervisor's work for the virtual disk is not this process's CPU time).
    Also the CPU the I/O itself burns: process CPU time over a matmul-free
    write+read, as a share of all cores.
    """
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)

    def matmuls_while(th: threading.Thread) -> float:
        count, t0 = 0, time.perf_counter()
        th.start()
        while th.is_alive():
            torch.mm(a, b)
            count += 1
        return (time.perf_counter() - t0) / max(count, 1)

    for _ in range(20):
        torch.mm(a, b)
    total = gib << 30
    cpu0, t0 = time.process_time(), time.perf_counter()
    _sequential_io(path, total, 8)
    io_cpu, io_wall = time.process_time() - cpu0, time.perf_counter() - t0
    alone, ours, dd = [], [], []
    for _ in range(rounds):
        alone.append(matmuls_while(threading.Thread(target=time.sleep, args=(io_wall,))))
        ours.append(matmuls_while(threading.Thread(target=_sequential_io, args=(path, total, 8))))
        dd.append(matmuls_while(threading.Thread(target=_dd_io, args=(path + ".dd", total))))
    return [("torch.mm 1024x1024 alone (s per matmul)", statistics.median(alone)),
            (f"torch.mm while aio writes+reads {gib} GiB, 8 in flight (s per matmul)",
             statistics.median(ours)),
            (f"torch.mm while dd writes+reads {gib} GiB, direct (s per matmul)",
             statistics.median(dd)),
            ("aio write+read alone: wall s", io_wall),
            ("aio write+read alone: process CPU s (all threads)", io_cpu),
            ("aio CPU share of the machine's cores", io_cpu / io_wall / (os.cpu_count() or 1)),
            ("matmul slowdown during capstan aio (median of per-round ratios)",
             statistics.median(o / x for o, x in zip(ours, alone, strict=True)) - 1),
            ("matmul slowdown during dd (median of per-round ratios)",
             statistics.median(d / x for d, x in zip(dd, alone, strict=True)) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--io-gib", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--overlap-gib", type=int, default=2)
    ap.add_argument("--deepspeed-python", default=None,
                    help="python of a separate venv with deepspeed (DeepSpeedCPUAdam comparison)")
    ap.add_argument("--only", default="adam,offload,casts,io,overlap,deepspeed",
                    help="comma-separated sections to run (adam-shared: capstan and torch fused "
                         "AdamW on the same tensors, for sizes like 1B where each cannot have its own; "
                         "moments: fp32 against bf16 and 8-bit moments; peers: with moments, bitsandbytes' "
                         "and torchao's 8-bit AdamW where they import)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    n = args.params
    print(f"Machine: {machine()}\n")
    if "adam" in only:
        print(f"### Adam step, {n / 1e6:.0f}M fp32 params (median of {args.reps})\n")
        print("| variant | s/step | Mparams/s | GB/s (28 B/param) | vs capstan |\n|---|---|---|---|---|")
        rows = bench_adam(n, args.reps)
        base = rows[0][1]
        for name, t in rows:
            print(f"| {name} | {t:.3f} | {n / t / 1e6:.0f} | {28 * n / t / 1e9:.2f} | {t / base:.2f}x |")
    if "moments" in only:
        print(f"\n### Adam with fp32, bf16 and 8-bit moments, {n / 1e6:.0f}M params (median of {args.reps}, "
              "interleaved)\n")
        print("| variant | s/step | GB/s of the bytes it touches | vs a copy of those bytes | vs capstan 8-bit |\n"
              "|---|---|---|---|---|")
        rows = bench_moments(n, args.reps, peers="peers" in only)
        copy_bw = {nb: nb / t for name, t, nb in rows if "copy_" in name}
        q8 = next(t for name, t, _ in rows if "q8" in name)  # (the fp32 master's: the first q8 row)
        for name, t, nb in rows:
            print(f"| {name} | {t:.3f} | {nb / t / 1e9:.2f} | {nb / t / copy_bw[nb]:.0%} | {t / q8:.2f}x |")
    if "adam-shared" in only:
        print(f"\n### Adam step on shared tensors, {n / 1e6:.0f}M fp32 params (median of {args.reps})\n")
        print("| variant | s/step | Mparams/s | GB/s | vs capstan |\n|---|---|---|---|---|")
        rows = bench_adam_shared(n, args.reps)
        base = rows[0][1]
        for i, (name, t) in enumerate(rows):
            nbytes = 28 * n if i < 2 else 4 * (n // 2) * 2
            rate = f"{n / t / 1e6:.0f}" if i < 2 else "-"
            print(f"| {name} | {t:.3f} | {rate} | {nbytes / t / 1e9:.2f} | {t / base:.2f}x |")
    if "deepspeed" in only and args.deepspeed_python:
        print(f"\n### CPUAdam vs DeepSpeedCPUAdam, {n / 1e6:.0f}M fp32 params, AdamW, "
              f"interleaved (median of {args.reps})\n")
        print("| optimizer | s/step | Mparams/s | vs capstan |\n|---|---|---|---|")
        rows = bench_vs_deepspeed(n, args.reps, args.deepspeed_python)
        for name, t in rows:
            print(f"| {name} | {t:.3f} | {n / t / 1e6:.0f} | {t / rows[0][1]:.2f}x |")
    if "offload" in only:
        print(f"\n### Offloaded step (bf16 grads, unscale + overflow check, AdamW, bf16 out), {n / 1e6:.0f}M\n")
        print("| variant | s/step | Mparams/s | vs capstan |\n|---|---|---|---|")
        rows = bench_offload_step(n, args.reps)
        for name, t in rows:
            print(f"| {name} | {t:.3f} | {n / t / 1e6:.0f} | {t / rows[0][1]:.2f}x |")
    if "casts" in only:
        print(f"\n### Casts and copies, {n / 1e6:.0f}M elements\n")
        print("| op | s | GB/s (bytes read + written) | vs capstan copy |\n|---|---|---|---|")
        rows = bench_casts(n, args.reps)
        copy_bw = next(nb / t for name, t, nb in rows if name == "capstan fp32 copy")
        for name, t, nbytes in rows:
            print(f"| {name} | {t:.4f} | {nbytes / t / 1e9:.2f} | {nbytes / t / copy_bw:.0%} |")
    if "io" in only:
        print(f"\n### Sequential file I/O, {args.io_gib} GiB in {args.dir} (median of 3 interleaved rounds)\n")
        print("| op | s | GB/s |\n|---|---|---|")
        for name, t, nbytes in bench_io(os.path.join(args.dir, "capstan-bench.bin"), args.io_gib):
            print(f"| {name} | {t:.2f} | {nbytes / t / 1e9:.2f} |")
    if "overlap" in only and args.overlap_gib > 0:
        print(f"\n### CPU left free by async I/O: torch matmul alone vs during aio "
              f"({args.overlap_gib} GiB write + read, 8 requests in flight), 5 alternating rounds\n")
        print("| measurement | value |\n|---|---|")
        rows = bench_overlap(os.path.join(args.dir, "capstan-overlap.bin"), args.overlap_gib)
        for name, t in rows[:5]:
            print(f"| {name} | {t:.4f} |")
        print(f"| {rows[5][0]} | {rows[5][1]:.1%} |")
        for name, t in rows[6:]:
            print(f"| {name} | {t:+.1%} |")


if __name__ == "__main__":
    main()
