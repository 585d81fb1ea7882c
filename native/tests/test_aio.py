"""Async file I/O: round trips with many requests in flight, and every failure raising cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from capstan import native
from capstan.native import aio

MiB = 1 << 20


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_random_offsets_many_in_flight(tmp_path, gen, direct):
    total, block = 128 * MiB, 512 * 1024  # 256 requests in flight at once
    data = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen)
    src, dst = aio.aligned_empty(total), aio.aligned_empty(total)
    src.copy_(data)
    order = torch.randperm(total // block, generator=gen).tolist()
    path = tmp_path / "chunks.bin"
    with aio.AsyncFile(path, "w+", direct=direct) as f:
        reqs = [f.write_from(src[i * block:(i + 1) * block], i * block) for i in order]
        assert sum(r.wait() for r in reqs) == total
        f.fsync().wait()
    order = torch.randperm(total // block, generator=gen).tolist()
    with aio.AsyncFile(path, "r", direct=direct) as f:
        reqs = [f.read_into(dst[i * block:(i + 1) * block], i * block) for i in order]
        while not all(r.done() for r in reqs):  # poll path
            pass
        assert all(r.wait() == block for r in reqs)
    assert torch.equal(dst, data)


def test_numpy_buffers_and_unaligned_buffered(tmp_path):
    import numpy as np

    a = np.arange(1000, dtype=np.int32)
    with aio.AsyncFile(tmp_path / "x", "w+", direct=False) as f:
        f.write_from(a, 12).wait()
        b = np.empty_like(a)
        f.read_into(b, 12).wait()
    assert (a == b).all()


def test_short_read_names_file_and_offset(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 8192)
    with aio.AsyncFile(path, "r") as f:
        req = f.read_into(aio.aligned_empty(16384), 4096)
        with pytest.raises(aio.AsyncIOError, match="offset 4096.*short read") as exc:
            req.wait()
    assert exc.value.filename == str(path)


def test_bad_fd_raises_with_errno(tmp_path):
    f = aio.AsyncFile(tmp_path / "bad.bin", "w+")
    os.close(f.fd)  # the fd goes away under the file object
    with pytest.raises(aio.AsyncIOError, match="offset 8192") as exc:
        f.write_from(aio.aligned_empty(4096), 8192).wait()
    assert exc.value.errno == 9  # EBADF
    f.fd = -1


def test_open_missing_file_raises(tmp_path):
    with pytest.raises(aio.AsyncIOError, match="No such file") as exc:
        aio.AsyncFile(tmp_path / "missing" / "x.bin", "r")
    assert "missing" in exc.value.filename


def test_direct_requires_alignment(tmp_path):
    with aio.AsyncFile(tmp_path / "a.bin", "w+") as f:
        if not f.direct:
            pytest.skip("requires O_DIRECT: this filesystem has none")
        with pytest.raises(ValueError, match="offset"):
            f.write_from(aio.aligned_empty(4096), 100)
        with pytest.raises(ValueError, match="buf size"):
            f.write_from(aio.aligned_empty(100), 0)
        with pytest.raises(ValueError, match="buf address"):
            f.write_from(aio.aligned_empty(8192)[1:4097], 0)
        with pytest.raises(TypeError, match="buf must be"):
            f.write_from(b"bytes", 0)


FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    from capstan.native import aio
    path, limit = sys.argv[1], int(sys.argv[2])
    # Writing past RLIMIT_FSIZE fails with EFBIG, exactly where a full disk
    # fails with ENOSPC; ignore SIGXFSZ so the call returns the error.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    buf = aio.aligned_empty(1 << 20)
    buf.fill_(7)
    with aio.AsyncFile(path, "w") as f:
        try:
            f.write_from(buf, limit - 4096).wait()
        except aio.AsyncIOError as exc:
            print("ERRNO", exc.errno, exc)
            sys.exit(0)
    print("NO ERROR")
""")


def test_write_into_full_filesystem_raises_and_keeps_contents(tmp_path):
    path = tmp_path / "full.bin"
    good = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8)
    with aio.AsyncFile(path, "w+") as f:
        buf = aio.aligned_empty(good.numel())
        buf.copy_(good)
        f.write_from(buf, 0).wait()
        f.fsync().wait()
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(path), str(8 * MiB)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ERRNO 27" in proc.stdout, proc.stdout + proc.stderr  # EFBIG
    assert f"offset {8 * MiB - 4096}" in proc.stdout and str(path) in proc.stdout
    back = torch.frombuffer(bytearray(path.read_bytes()[:4 * MiB]), dtype=torch.uint8)
    assert torch.equal(back, good)


def test_aligned_empty_alignment():
    for n in (1, 4097, 3 * MiB):
        t = aio.aligned_empty(n, torch.float32)
        assert t.data_ptr() % aio.ALIGNMENT == 0 and t.numel() == n
    with pytest.raises(ValueError, match="numel"):
        aio.aligned_empty(0)


def _mapping_of(addr: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry whose range holds addr: its range and fields, or None."""
    entry: dict[str, str] | None = None
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = {"start": str(lo), "end": str(hi)} if lo <= addr < hi else None
        elif entry is not None and ":" in head:
            entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
        if entry is not None and "VmFlags" in entry:
            return entry
    return entry


@pytest.mark.skipif(not native.status()["loaded"], reason="requires_native: the fallback allocates with torch")
def test_large_aligned_buffer_is_its_own_huge_page_mapping_and_freed_to_the_os():
    """Buffers of >= 2 MiB: their own 2 MiB-aligned mapping, THP-advised, unmapped when freed."""
    t = aio.aligned_empty(6 * MiB + 4096)
    t.fill_(1)
    addr = t.data_ptr()
    vma = _mapping_of(addr)
    assert vma is not None and int(vma["start"]) == addr and addr % (2 * MiB) == 0
    assert int(vma["end"]) - addr == 6 * MiB + 4096
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    advised = "hg" in vma["VmFlags"].split()  # the madvise(MADV_HUGEPAGE) flag
    assert advised == ("[never]" not in thp), (vma["VmFlags"], thp)
    del t
    assert _mapping_of(addr) is None or int(_mapping_of(addr)["start"]) != addr
    small = aio.aligned_empty(MiB)  # below a huge page: the heap, as before
    assert small.data_ptr() % aio.ALIGNMENT == 0


def test_a_block_pool_reuses_freed_buffers_within_its_room_and_never_one_still_in_use():
    """A freed buffer goes to the pool only when nothing refers to it any more (a view keeps it), and only
    within the room; the next buffer of its size is that one (no fresh mapping to fault in); a smaller
    room frees what the pool keeps beyond it, and a closed pool keeps nothing."""
    room = [8 * MiB]
    pool = aio.BlockPool(lambda: room[0])
    a = aio.aligned_empty(4 * MiB, pool=pool)
    a.fill_(3)
    first, view = a.data_ptr(), a[MiB:]
    del a
    assert pool.nbytes == 0  # the view still reads it
    assert int(view[0]) == 3
    del view
    assert pool.nbytes == 4 * MiB
    b = aio.aligned_empty(4 * MiB, pool=pool)
    assert b.data_ptr() == first and pool.reused == 1 and pool.nbytes == 0
    other = aio.aligned_empty(2 * MiB, pool=pool)  # another size: a fresh buffer
    assert other.data_ptr() != first
    room[0] = 5 * MiB
    del b, other  # 4 MiB fits the room, then the 2 MiB one does not
    assert pool.nbytes == 4 * MiB
    room[0] = MiB
    pool.make_room()
    assert pool.nbytes == 0
    room[0] = 64 * MiB
    pool.close()
    c = aio.aligned_empty(4 * MiB, pool=pool)
    del c
    assert pool.nbytes == 0


FIRST_FAILURE = textwrap.dedent("""
    import resource, signal, sys
    from capstan.native import aio
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
    buf = aio.aligned_empty(1 << 20)
    buf.fill_(7)
    try:
        with aio.AsyncFile(sys.argv[1], "w+") as f:
            reqs = [f.write_from(buf, k << 20) for k in range(12)]
            for r in reqs:
                r.wait()
    except aio.AsyncIOError as exc:
        print("FIRST", exc)
""")


def test_the_first_failure_is_the_one_raised_through_the_with_block(tmp_path):
    """A request's error inside `with AsyncFile` is not replaced by a later request's error at close."""
    path = tmp_path / "limited.bin"
    proc = subprocess.run([sys.executable, "-c", FIRST_FAILURE, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"at offset {4 * MiB} failed" in proc.stdout, proc.stdout
