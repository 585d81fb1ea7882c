"""`capstan bench-disk DIR`: how fast can chunks go to this disk, and what does that mean per step?

Offloading to disk pays off or not depending on numbers users rarely have at
hand (DeepSpeed's users ask on its tracker whether NVMe offload "needs
3 GB/s per GPU"). This measures them where the disk tier would write, with the
same I/O path the tier uses (capstan.native.aio: direct I/O when the
filesystem allows it, `inflight` requests of `block` bytes in flight), plus
the two CPU rates an offloaded step also needs (a RAM copy and capstan's CPU
Adam), and turns them into lower bounds on the step time of a model whose
optimizer states live on that disk.

The sizing model, stated so it can be checked: with `chunkmem` keeping the
optimizer's chunks on disk, every step reads and writes each parameter's fp32
master copy, exp_avg and exp_avg_sq once (12 bytes each way), and the CPU runs
Adam over every parameter. The step cannot be faster than the larger of the
disk time and the Adam time (they overlap at best); forward and backward come
on top. Gradients and 16-bit parameters are assumed to stay in RAM.

Example::

    capstan bench-disk /nvme/scratch --size-mib 1024 --params 7B
    capstan bench-disk /tmp --json
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from pathlib import Path

import torch

__all__ = ["DiskBenchError", "bench_disk", "offload_floor", "parse_count", "format_report", "stream_file",
           "STATE_BYTES_PER_PARAM"]

MiB = 1 << 20
# fp32 master copy + exp_avg + exp_avg_sq: what the disk tier reads and writes per parameter per step.
STATE_BYTES_PER_PARAM = 12
# The CPU rates are measured on this many elements (big enough to leave the caches).
_CPU_ELEMENTS = 16 * MiB


class DiskBenchError(ValueError):
    """Bad arguments or a directory the benchmark cannot use; the message names which."""


def parse_count(text: str) -> int:
    """A parameter count: an integer, or a number with K, M, B (or G) or T, e.g. "7B", "350M"."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    s = text.strip().upper().replace("_", "")
    try:
        value = float(s[:-1]) * scale[s[-1]] if s and s[-1] in scale else float(s)
    except ValueError:
        raise DiskBenchError(f"--params {text!r}: expected a count such as 1000000, 350M or 7B") from None
    if not value >= 1:
        raise DiskBenchError(f"--params {text!r}: must be at least 1")
    return int(value)


def _check_args(directory: str | os.PathLike, size: int, block: int, inflight: int, rounds: int) -> Path:
    path = Path(directory)
    if not path.is_dir():
        raise DiskBenchError(f"bench-disk: {path} is not a directory"
                             + ("" if path.exists() else " (it does not exist)"))
    if not os.access(path, os.W_OK | os.X_OK):
        raise DiskBenchError(f"bench-disk: cannot write into {path}")
    if block < 4096 or block % 4096:
        raise DiskBenchError(f"bench-disk: --block-mib gives {block} bytes; direct I/O needs a multiple of 4096")
    if size < block or size % block:
        raise DiskBenchError(f"bench-disk: --size-mib ({size // MiB} MiB) must be a positive multiple of "
                             f"--block-mib ({block // MiB} MiB)")
    if inflight < 1:
        raise DiskBenchError(f"bench-disk: --inflight must be at least 1, got {inflight}")
    if rounds < 1:
        raise DiskBenchError(f"bench-disk: --rounds must be at least 1, got {rounds}")
    return path


def stream_file(f, buf: torch.Tensor, size: int, block: int, inflight: int, write: bool) -> None:
    """Write (then fsync) or read `size` bytes of the open `aio.AsyncFile` f sequentially, at most
    `inflight` requests of `block` bytes queued, cycling through `buf` (inflight * block bytes)."""
    queue = []
    for k, offset in enumerate(range(0, size, block)):
        if len(queue) == inflight:
            queue.pop(0).wait()
        piece = buf[(k % inflight) * block:(k % inflight + 1) * block]
        queue.append(f.write_from(piece, offset) if write else f.read_into(piece, offset))
    for r in queue:
        r.wait()
    if write:
        f.fsync().wait()


def _disk_rates(path: Path, size: int, block: int, inflight: int, rounds: int) -> dict:
    from capstan.native import aio

    target = path / f".capstan-bench-disk-{uuid.uuid4().hex}.bin"
    buf = aio.aligned_empty(inflight * block)
    buf.fill_(0x5A)
    writes, reads, direct = [], [], False
    try:
        for _ in range(rounds):
            with aio.AsyncFile(target, "w+") as f:
                direct = f.direct
                t = time.perf_counter()
                stream_file(f, buf, size, block, inflight, write=True)
                writes.append(time.perf_counter() - t)
            with aio.AsyncFile(target, "r", direct=direct) as f:
                t = time.perf_counter()
                stream_file(f, buf, size, block, inflight, write=False)
                reads.append(time.perf_counter() - t)
    except OSError as exc:  # ENOSPC, EFBIG, EIO: the message names the file and offset
        raise DiskBenchError(f"bench-disk: {exc}") from exc
    finally:
        target.unlink(missing_ok=True)
    return {"direct": direct, "write_gbs": size / statistics.median(writes) / 1e9,
            "read_gbs": size / statistics.median(reads) / 1e9}


def _cpu_rates() -> dict:
    """RAM copy bandwidth (bytes read + written) and capstan's CPU Adam rate, medians of 5."""
    from capstan import native
    from capstan.native import kernels

    n = _CPU_ELEMENTS
    src, dst = torch.ones(n), torch.empty(n)
    p, g, m, v = torch.zeros(n), torch.full((n,), 1e-3), torch.zeros(n), torch.zeros(n)
    copies, steps = [], []
    for step in range(1, 7):
        t = time.perf_counter()
        kernels.copy_(dst, src)
        copies.append(time.perf_counter() - t)
        t = time.perf_counter()
        kernels.adam_update(p, g, m, v, step=step, lr=1e-3, weight_decay=0.01)
        steps.append(time.perf_counter() - t)
    return {"ram_copy_gbs": 8 * n / statistics.median(copies[1:]) / 1e9,
            "adam_params_per_s": n / statistics.median(steps[1:]),
            "cpu_threads": native.status().get("threads"), "native_loaded": native.status()["loaded"]}


def bench_disk(directory: str | os.PathLike, size: int = 1024 * MiB, block: int = 8 * MiB,
               inflight: int = 8, rounds: int = 1) -> dict:
    """Measure sequential write and read of `size` bytes in `directory` (median of `rounds`), the RAM
    copy bandwidth and the CPU Adam rate. The file is removed afterwards, also on failure."""
    path = _check_args(directory, size, block, inflight, rounds)
    result = {"directory": str(path), "size_bytes": size, "block_bytes": block, "inflight": inflight,
              "rounds": rounds}
    result.update(_disk_rates(path, size, block, inflight, rounds))
    result.update(_cpu_rates())
    return result


def offload_floor(params: int, rates: dict) -> dict:
    """Lower bounds on one step's seconds for `params` parameters whose optimizer states are on disk."""
    nbytes = STATE_BYTES_PER_PARAM * params
    read_s, write_s = nbytes / (rates["read_gbs"] * 1e9), nbytes / (rates["write_gbs"] * 1e9)
    adam_s = params / rates["adam_params_per_s"]
    disk_s = read_s + write_s
    return {"params": params, "disk_bytes_per_step": 2 * nbytes, "disk_read_s": read_s,
            "disk_write_s": write_s, "disk_s": disk_s, "adam_s": adam_s,
            "step_floor_s": max(disk_s, adam_s), "bound_by": "disk" if disk_s >= adam_s else "cpu adam"}


def format_report(rates: dict, floor: dict | None) -> str:
    mode = ("direct I/O" if rates["direct"] else
            "buffered I/O (the filesystem refused O_DIRECT; the read may come from the page cache)")
    lines = [
        f"capstan bench-disk {rates['directory']}: {mode}, {rates['inflight']} requests of "
        f"{rates['block_bytes'] // MiB} MiB in flight, {rates['size_bytes'] / 2**30:.2f} GiB, "
        f"median of {rates['rounds']} round(s)",
        f"  write      {rates['write_gbs']:.2f} GB/s",
        f"  read       {rates['read_gbs']:.2f} GB/s",
        f"  RAM copy   {rates['ram_copy_gbs']:.1f} GB/s",
        f"  CPU Adam   {rates['adam_params_per_s'] / 1e6:.0f} M params/s",
    ]
    if floor is not None:
        lines += [
            f"a model of {floor['params'] / 1e9:.3g}B parameters with its optimizer states "
            f"({STATE_BYTES_PER_PARAM} B/param) on this disk, per step at least:",
            f"  disk       {floor['disk_s']:.2f} s ({floor['disk_bytes_per_step'] / 1e9:.1f} GB: read "
            f"{floor['disk_read_s']:.2f} s + write {floor['disk_write_s']:.2f} s)",
            f"  CPU Adam   {floor['adam_s']:.2f} s",
            f"  so >= {floor['step_floor_s']:.2f} s per step before forward and backward; bound by "
            f"{floor['bound_by']}",
        ]
    return "\n".join(lines)
