"""How Adam's moments in fewer bits see a chunk: the runs bf16 rounding draws its bits for, and where
8-bit codes and scales live.

bf16 moments (`ChunkedModel(moment_dtype=torch.bfloat16)`) round stochastically from each element's
canonical index: `rounding_spans` cuts a chunk into runs of slots consecutive in that order. An 8-bit
moment chunk (`moment_dtype=torch.uint8`) holds one uint8 code per element at the parameters' offsets
(as an fp32 chunk would hold the values), then one fp32 scale per block of `BLOCK` values of each
parameter, the parameters' blocks in slot order, 64-byte aligned; the whole chunk is a number of 4 KiB
pages, which the disk tier's direct I/O moves whole. `Q8Layout` tells optim/moments.py's kernel call
and state_io's checkpoint reads where each parameter's codes and scales are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from capstan.native import kernels, q8

__all__ = ["BLOCK", "Q8Layout", "chunk_bytes", "q8_layout", "rounding_spans", "scale_offset"]

# A parameter in its chunk: (name, slot offset, numel, canonical index of its first element).
Slot = tuple[str, int, int, int]

BLOCK = q8.BLOCK  # values per scale
PAGE = 4096


def scale_offset(size: int) -> int:
    """Byte offset of the block scales in a moment chunk beside `size`-element chunks."""
    return -(-size // 64) * 64


def chunk_bytes(size: int, blocks: int) -> int:
    """Bytes (uint8 elements) of a moment chunk beside `size`-element chunks holding `blocks` blocks."""
    return -(-(scale_offset(size) + 4 * blocks) // PAGE) * PAGE


@dataclass(frozen=True)
class Q8Layout:
    """One chunk group's 8-bit moments: `segments` (offset, numel, canonical index) per parameter in slot
    order (kernels.adam_update_q8), the scales' byte offset and count, and each parameter's first block."""

    segments: list[tuple[int, int, int]]
    scale_offset: int
    blocks: int
    first_block: dict[str, int]

    def scales(self, payload: torch.Tensor) -> torch.Tensor:
        """The fp32 scales inside a moment chunk's (uint8) payload."""
        return payload[self.scale_offset : self.scale_offset + 4 * self.blocks].view(torch.float32)

    def parts(self, payload: torch.Tensor, name: str, offset: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and the block scales of parameter `name` (at `offset`, `numel` elements): views."""
        first = self.first_block[name]
        return payload.narrow(0, offset, numel), self.scales(payload)[first : first + kernels.q8_blocks([numel], BLOCK)]


def rounding_spans(slots: list[Slot]) -> list[tuple[int, int, int]]:
    """The chunk as runs of slots consecutive in the canonical order: (start, end, canonical index of
    start), in chunk order; the stochastic rounding of bf16 moments draws from the canonical index."""
    spans: list[tuple[int, int, int]] = []
    for _, lo, numel, base in sorted(slots, key=lambda s: s[1]):
        if spans and spans[-1][1] == lo and spans[-1][2] + (lo - spans[-1][0]) == base:
            spans[-1] = (spans[-1][0], lo + numel, spans[-1][2])
        else:
            spans.append((lo, lo + numel, base))
    return spans


def q8_layout(slots: list[Slot], size: int) -> Q8Layout:
    """The layout of a chunk whose parameters are `slots` (name, offset, numel, canonical index) beside
    `size`-element chunks."""
    slots = sorted(slots, key=lambda s: s[1])
    firsts, blocks = {}, 0
    for name, _, numel, _ in slots:
        firsts[name] = blocks
        blocks += kernels.q8_blocks([numel], BLOCK)
    return Q8Layout([(off, numel, index) for _, off, numel, index in slots], scale_offset(size), blocks, firsts)
