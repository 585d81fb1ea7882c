"""Saved-tensor hooks that keep autograd from pinning evicted parameter chunks in memory.

Autograd saves what backward needs during forward; for `F.linear` that is a
view of the weight (`weight.t()`), which holds the chunk's *buffer*, not the
parameter. Evicting the chunk then swaps `param.data` but the graph keeps the
old buffer alive until backward: RAM the manager believes free, outside every
budget. These hooks save such a view as (chunk, offset, shape, stride) and
rebuild it at backward from the chunk's payload of that moment, which the
module's pre-backward access has made resident again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .chunk import Chunk

__all__ = ["ChunkViewSaver"]


@dataclass(frozen=True)
class _ChunkRef:
    chunk: Chunk
    offset: int  # elements from the start of the chunk's payload
    shape: torch.Size
    stride: tuple[int, ...]


class ChunkViewSaver:
    """pack/unpack hooks for `torch.autograd.graph.saved_tensors_hooks`."""

    def __init__(self) -> None:
        self._by_storage: dict[int, list[Chunk]] = {}  # storage address -> chunks whose payload lives there

    def resident(self, chunk: Chunk) -> None:
        assert chunk.payload is not None
        self._by_storage.setdefault(chunk.payload.untyped_storage().data_ptr(), []).append(chunk)

    def leaving(self, chunk: Chunk) -> None:
        """Called while the payload is still set, just before it is dropped."""
        if chunk.payload is None:
            return
        ptr = chunk.payload.untyped_storage().data_ptr()
        chunks = self._by_storage.get(ptr, [])
        if chunk in chunks:
            chunks.remove(chunk)
        if not chunks:
            self._by_storage.pop(ptr, None)

    def pack(self, t: torch.Tensor) -> object:
        if not self._by_storage or t.layout is not torch.strided or t.numel() == 0:
            return t
        chunks = self._by_storage.get(t.untyped_storage().data_ptr())
        if not chunks:
            return t
        offset = t.storage_offset()
        for chunk in chunks:
            base = chunk.payload.storage_offset()  # type: ignore[union-attr]
            if base <= offset < base + chunk.payload.numel():  # type: ignore[union-attr]  # a gathered remote chunk's payload is its used part (sharding.py)
                return _ChunkRef(chunk, offset - base, t.shape, t.stride())
        return t

    @staticmethod
    def unpack(saved: object) -> torch.Tensor:
        if not isinstance(saved, _ChunkRef):
            return saved  # type: ignore[return-value]
        payload = saved.chunk.payload
        if payload is None:
            raise RuntimeError(
                f"backward needs chunk {saved.chunk.chunk_id} but it is not resident: a module used "
                "parameters of another module without calling it (mark it atomic: ChunkedModel(atomic_types=...))"
            )
        return payload.as_strided(saved.shape, saved.stride, payload.storage_offset() + saved.offset)
