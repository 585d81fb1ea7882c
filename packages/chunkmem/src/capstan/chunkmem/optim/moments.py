"""How Adam's moments are stored: fp32, bf16 chunks that the native kernel updates in fp32 and stores
with stochastic rounding (capstan.native.kernels.adam_update's `seed` and `index_base`), or 8-bit chunks
of block-wise quantized codes with their scales behind them (kernels.adam_update_q8, `Q8Layout`).

The rounding's random bits are a hash of (step, element), where an element is numbered by its place in
the model's canonical parameter order (`ChunkedModel.rounding_spans`): the parameter groups in order, each
group's parameters as listed -- the order of capstan.engine's flat ZeRO buffer. So chunked, sharded and
flat layouts draw the same bits for the same element at the same step, and keep training the same
trajectory with bf16 moments as they do with fp32 ones. 8-bit moments quantize in blocks that start at each
parameter's first element, so every layout that keeps parameters whole (chunks in any tier, ZeRO-3's owned
chunks, the flat unsharded buffer) draws the same blocks and bits too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from capstan.native import kernels

from ..model.moment_layout import BLOCK as Q8_BLOCK
from ..model.moment_layout import Q8Layout

__all__ = ["step_chunk"]


def step_chunk(update: Callable[..., bool], views: Sequence[torch.Tensor], args: dict,
               spans: list[tuple[int, int, int]] | Q8Layout) -> None:
    """`update(*views, **args)` (kernels.adam_update or adam_update_and_cast over one chunk group's
    sibling views): one call over the whole chunk with fp32 moments and master; with bf16 moments or a bf16
    master (which rounds stochastically too) one call per run of slots that are consecutive in the
    canonical order (`spans`: (start, end, canonical index of start),
    `ChunkedModel.rounding_spans`), each drawing its bits from `args["step"]` and its canonical index.
    Padding between slots stays as it is. 8-bit moments (`spans` is the chunk's `Q8Layout`, the moment
    views whole payloads, `ChunkedModel.step_view`): one adam_update_q8 over the parameters' segments,
    with the 16-bit output where `views` has a fifth."""
    if isinstance(spans, Q8Layout):
        master, grad, m, v = views[:4]
        n = master.numel()
        kernels.adam_update_q8(master, grad, m[:n], v[:n], spans.scales(m), spans.scales(v), block=Q8_BLOCK,
                               segments=spans.segments, seed=args["step"], out=views[4] if len(views) > 4 else None,
                               **args)
        return
    if views[2].dtype == torch.float32 and views[0].dtype == torch.float32:
        update(*views, **args)
        return
    for lo, hi, base in spans:
        update(*(t[lo:hi] for t in views), **args, seed=args["step"], index_base=base)
