"""`Chunk`: one fixed-size contiguous buffer holding many tensors as views.

A chunk knows its tensors (name, offset, shape, state) and its payload (a
1-D tensor of `capacity` elements, or None while the data lives elsewhere).
It knows nothing of ranks or tiers: where the payload sits is the
manager's business (see `manager.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .states import ChunkKind, ChunkState, TensorState, check_transition, chunk_state_of

__all__ = ["Chunk", "TensorSlot"]


@dataclass
class TensorSlot:
    """Where one tensor lives inside its chunk."""

    name: str
    offset: int  # in elements
    shape: torch.Size
    state: TensorState = TensorState.HOLD

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(eq=False)
class Chunk:
    """A fixed-size buffer of `capacity` elements of `dtype` holding `slots` back to back."""

    chunk_id: int
    kind: ChunkKind
    dtype: torch.dtype
    capacity: int
    slots: list[TensorSlot] = field(default_factory=list)
    payload: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the chunk occupies wherever it lives: always the full capacity (exact budgets)."""
        return self.capacity * self.dtype.itemsize  # (not torch.empty(0).element_size(): every budget check asks)

    @property
    def used(self) -> int:
        """Elements occupied by tensors (the rest is padding)."""
        return max((s.offset + s.numel for s in self.slots), default=0)

    def add(self, name: str, shape: torch.Size, offset: int | None = None) -> TensorSlot:
        """Place a tensor at the end of the chunk (or at `offset`, to mirror a sibling chunk)."""
        offset = self.used if offset is None else offset
        if offset + shape.numel() > self.capacity:
            raise ValueError(f"{name} ({shape.numel()} elements) does not fit chunk {self.chunk_id} at {offset}")
        slot = TensorSlot(name=name, offset=offset, shape=torch.Size(shape))
        self.slots.append(slot)
        return slot

    def view(self, slot: TensorSlot) -> torch.Tensor:
        """The tensor `slot` as a view into the payload (which must be present)."""
        if self.payload is None:
            raise RuntimeError(f"chunk {self.chunk_id} ({self.kind.value}) has no payload in memory")
        return self.payload.narrow(0, slot.offset, slot.numel).view(slot.shape)

    @property
    def state(self) -> ChunkState:
        return chunk_state_of([s.state for s in self.slots]) if self.slots else ChunkState.FREE

    def set_state(self, slot: TensorSlot, new: TensorState) -> None:
        check_transition(slot.state, new, f"{slot.name} in chunk {self.chunk_id}")
        slot.state = new

    def __repr__(self) -> str:
        return (f"Chunk({self.chunk_id}, {self.kind.value}, {self.dtype}, {self.used}/{self.capacity}, "
                f"{len(self.slots)} tensors, {'resident' if self.payload is not None else 'not resident'})")
