"""The on-disk format of capstan checkpoints: safetensors shard files plus one JSON manifest.

A checkpoint is a directory ``step_00000040/`` holding

* ``rank_00003.safetensors`` per rank: the pieces of parameters and optimizer
  moments this rank owns (fp32, flat), and its RNG states. A plain safetensors
  file (8-byte little-endian header length, JSON header, raw data), so any
  safetensors reader can open it;
* ``manifest.json``: the layout it was written under, the step and the training
  state, the logical shape and tensor-parallel split of every parameter, and
  for every piece where it lives (file, byte offset, CRC-32) and which part of
  which tensor it is (tensor-parallel rank, flat range of that rank's slice).

Pieces are described in terms of the *model*, not of the writer's memory
layout, so any layout can read them back (`state`). Writing streams one
piece at a time (bounded memory); reading uses ``pread`` into a fresh buffer
(no mmap: file pages never count against the reader's resident memory).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "FORMAT", "VERSION", "MANIFEST", "Entry", "write_safetensors", "read_bytes", "read_tensor",
    "fsync_dir", "file_sha256", "DTYPE_CODES",
]

FORMAT = "capstan-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"

DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8",
               torch.int64: "I64"}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_NUMPY = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I64": np.int64}


@dataclass
class Entry:
    """One tensor of a shard file: its key, shape and dtype up front, its data produced on demand."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()


def _header(entries: Sequence[Entry], metadata: dict[str, str]) -> bytes:
    """The safetensors header, padded with spaces so the data starts 8-byte aligned."""
    head: dict[str, object] = {"__metadata__": metadata}
    pos = 0
    for e in entries:
        head[e.key] = {"dtype": DTYPE_CODES[e.dtype], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return raw


def write_safetensors(path: Path, entries: Sequence[Entry], metadata: dict[str, str] | None = None,
                      ) -> tuple[dict[str, tuple[int, int, int]], str, int]:
    """Write `entries` to `path` (via ``path.tmp``, fsynced, renamed); streams one entry at a time.

    Returns ({key: (absolute byte offset, nbytes, crc32)}, sha256 of the file, file size).
    """
    header = _header(entries, metadata or {})
    tmp = path.with_name(path.name + ".tmp")
    sha = hashlib.sha256()
    where: dict[str, tuple[int, int, int]] = {}
    prefix = struct.pack("<Q", len(header)) + header
    total = len(prefix) + sum(e.nbytes for e in entries)
    pos = 0
    try:
        with open(tmp, "wb") as f:
            f.write(prefix)
            sha.update(prefix)
            pos = len(prefix)
            for e in entries:
                t = e.produce().detach()
                if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                    raise ValueError(f"{path}: entry {e.key} produced {t.dtype} {tuple(t.shape)}, "
                                     f"announced {e.dtype} {e.shape}")
                data = _as_bytes(t)
                f.write(data)
                sha.update(data)
                where[e.key] = (pos, len(data), zlib.crc32(data))
                pos += len(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:  # a full disk (or quota): say which file and how far it got, leave no part behind
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"writing {path} ({total} bytes; about {pos} written) failed: "
                                 f"{exc.strerror or exc}") from None
    tmp.replace(path)
    return where, sha.hexdigest(), pos


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def read_bytes(path: Path, offset: int, nbytes: int) -> bytes:
    """`nbytes` from `offset` of `path` with pread; a short read names the file as truncated."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
    if len(data) != nbytes:
        raise EOFError(f"{path} is truncated: wanted {nbytes} bytes at offset {offset}, got {len(data)}")
    return data


def read_tensor(path: Path, offset: int, nbytes: int, dtype: str, crc: int | None = None) -> torch.Tensor:
    """A flat tensor of safetensors dtype code `dtype` read from `path`, checked against `crc`."""
    data = read_bytes(path, offset, nbytes)
    if crc is not None and zlib.crc32(data) != crc:
        raise ValueError(f"{path} is corrupt: checksum mismatch in bytes {offset}..{offset + nbytes}")
    if dtype == "BF16":
        return torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.frombuffer(data, dtype=_NUMPY[dtype]).copy())


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            sha.update(chunk)
    return sha.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
