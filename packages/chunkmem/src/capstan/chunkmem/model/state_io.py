"""Read and write one parameter's training state in a `ChunkedModel`: for checkpoints.

A checkpoint wants, per parameter, three tensors: the parameter (fp32: the
master copy in mixed precision; bf16 for a bf16 master), and Adam's ``exp_avg`` and ``exp_avg_sq`` (fp32,
or bf16 where the model keeps them so: `ChunkedModel.moment_dtype`; 8-bit ones
are read as their exact fp32 values and written back by rounding to nearest,
which gives back the very codes and scales they were read from: capstan.native.q8).
These live at the parameter's slot in sibling chunks, which may be on disk;
each call brings the chunk in through the manager (so the RAM budget holds)
and releases it, outside the manager's trace (`off_trace`): a save or a
resume runs between steps, and its accesses recorded as moments would shift
the next step's device capacity, prefetch and Belady order (a resume's would
have become the head of the warm-up trace for the whole run). Only chunks this rank owns have optimizer state
(`owned_homes`); with ZeRO-3 sharding every parameter is owned by exactly one
data-parallel rank.

    for home in owned_homes(model):
        t = read_state(model, home, "exp_avg")       # a copy, as the chunk keeps it
        write_state(model, home, "exp_avg", t)
"""

from __future__ import annotations

import torch

from capstan.native import q8

from .chunked import MOMENT_KINDS, Q8_BLOCK, ChunkedModel, ParamHome
from .states import ChunkKind

__all__ = ["FIELDS", "owned_homes", "read_state", "write_state"]

FIELDS = ("param", "exp_avg", "exp_avg_sq")


def owned_homes(model: ChunkedModel) -> list[ParamHome]:
    """The parameters whose chunks (and optimizer state) this rank keeps, in registration order."""
    owned = {(g, i) for g in range(len(model.chunks[ChunkKind.PARAM])) for i in model.owned_indices(g)}
    return [h for h in model.homes.values() if (h.group, h.index) in owned]


def _kind(model: ChunkedModel, field: str) -> ChunkKind:
    if field == "param":
        return ChunkKind.MASTER if model.mixed else ChunkKind.PARAM
    if field == "exp_avg":
        return ChunkKind.EXP_AVG
    if field == "exp_avg_sq":
        return ChunkKind.EXP_AVG_SQ
    raise ValueError(f"unknown state field {field!r}; expected one of {FIELDS}")


def read_state(model: ChunkedModel, home: ParamHome, field: str) -> torch.Tensor:
    """A copy of `field` of the parameter at `home` (an owned one): the master's dtype (fp32, or a bf16
    master as it is), the moments in the model's moment dtype (bf16 ones are saved as they are), 8-bit ones
    as their exact fp32 values."""
    kind = _kind(model, field)
    chunk = model.chunk_of(home, kind)
    with model.manager.off_trace():  # between steps: out of the trace (module docstring)
        model.manager.access(chunk.chunk_id)
    try:
        if model.q8 and kind in MOMENT_KINDS:
            codes, scales = _q8_parts(model, home, chunk)
            return q8.dequantize(codes, scales, field, Q8_BLOCK).view(home.slot.shape)
        return chunk.view(home.slot).clone()  # (the master / fp32 PARAM chunk, or the moments' own dtype)
    finally:
        model.manager.release(chunk.chunk_id)


def _q8_parts(model: ChunkedModel, home: ParamHome, chunk) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """The codes and the block scales of `home`'s parameter in 8-bit moment `chunk` (resident): views."""
    return model.q8_layout(home.group, home.index).parts(chunk.payload, home.name, home.slot.offset, home.slot.numel)


def write_state(model: ChunkedModel, home: ParamHome, field: str, value: torch.Tensor) -> None:
    """Set `field` of the parameter at `home` (an owned one); a parameter also updates its 16-bit copy."""
    if tuple(value.shape) != tuple(home.slot.shape):
        raise ValueError(f"{home.name}: {field} of shape {tuple(value.shape)}, expected {tuple(home.slot.shape)}")
    kinds = [_kind(model, field)]
    if field == "param" and model.mixed:
        kinds.append(ChunkKind.PARAM)
    for kind in kinds:
        chunk = model.chunk_of(home, kind)
        with model.manager.off_trace():  # between steps: out of the trace (module docstring)
            model.manager.access(chunk.chunk_id, write=True)
        try:
            if model.q8 and kind in MOMENT_KINDS:
                codes, scales = _q8_parts(model, home, chunk)
                new_codes, new_scales = q8.quantize(value, field, Q8_BLOCK)
                codes.copy_(new_codes)
                scales.copy_(new_scales)
                continue
            chunk.view(home.slot).copy_(value)
        finally:
            model.manager.release(chunk.chunk_id)
