"""Compressed data-parallel communication for `ZeroOptimizer` (``parallel.compression``).

* `OneBitAdam` ("onebit", Tang et al. 2021, "1-bit Adam"): the first
  ``compression_freeze_steps`` steps are exact AdamW (gradients all-reduced in
  fp32). Adam's variance then changes slowly, so it is frozen, and each rank
  keeps updating the momentum from its *own* gradient; the momentum is
  averaged over dp with `comm.onebit_all_reduce` (signs and a scale, with
  error feedback through a worker and a server residual per rank), and the
  parameters step with the averaged momentum over the frozen variance. The
  gradients themselves never cross the network after the freeze.
  Every dp rank ends each step with the same momentum and parameters.
  At tp > 1 the tp-sliced and the replicated parameters are compressed apart
  (`ZeroOptimizer.regions`): a scale taken over the replicated parameters
  alone is the same on every tp rank, so they stay identical across tp.
* `int8_reduce_scatter` / `int8_all_gather` ("int8", ZeRO++'s qgZ and qwZ,
  Wang et al. 2023): ZeRO 1/2's gradient reduction and the all-gather of the
  updated parameters travel as int8 blocks with a scale each. The optimizer
  keeps this rank's shard of the fp32 master weights exact beside the flat
  buffer (`ZeroOptimizer.master`); forward and backward use the gathered
  (dequantized) values, the same on every rank.

1-bit Adam's residuals are this rank's own state: checkpoints keep them per
rank (`state_tensors`) and a resume under the same layout continues exactly;
under another layout they start from zero (error feedback then only forgets
what the last steps had not yet sent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from capstan import comm
from capstan.chunkmem.optim.onebit import compressed_momentum, frozen_variance_step

__all__ = ["OneBitAdam", "int8_reduce_scatter", "int8_all_gather"]


class OneBitAdam:
    """The compressed phase of 1-bit Adam over `ZeroOptimizer`'s flat buffers (ZeRO 0: every rank holds
    every parameter and the whole momentum)."""

    def __init__(self, ranges: Sequence[tuple[int, int]], group: comm.Group, freeze_steps: int,
                 device: torch.device) -> None:
        self.ranges, self.group, self.freeze_steps = list(ranges), group, freeze_steps
        self.worker: list[torch.Tensor] = []
        self.server: list[torch.Tensor] = []
        for a, b in self.ranges:
            w, s = comm.onebit_residual_sizes(b - a, group.size)
            self.worker.append(torch.zeros(w, device=device))
            self.server.append(torch.zeros(s, device=device))

    def compressing(self, steps_taken: int) -> bool:
        """True once `steps_taken` optimizer steps of exact AdamW are behind (the next step is compressed)."""
        return steps_taken >= self.freeze_steps

    def step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
             pieces: Sequence[tuple[int, int, float]], step: int, lr: float, beta1: float, beta2: float,
             eps: float, grad_scale: float) -> None:
        """One compressed step: the momentum of each region (`compressed_momentum`: this rank's gradient in,
        averaged over dp in 1 bit), then AdamW with it over the variance frozen at the freeze step.
        pieces: (start, end, weight decay) of the flat buffer. Elements outside every region (the flat
        buffer's padding) have no gradient and keep a zero momentum."""
        for (a, b), w, s in zip(self.ranges, self.worker, self.server):
            compressed_momentum(exp_avg[a:b], grad[a:b], w, s, self.group, beta1=beta1, grad_scale=grad_scale)
        for a, b, wd in pieces:
            frozen_variance_step(param[a:b], exp_avg[a:b], exp_avg_sq[a:b], step=step, freeze_steps=self.freeze_steps,
                                 lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's residuals by key, for its checkpoint file."""
        out = {}
        for i, (w, s) in enumerate(zip(self.worker, self.server)):
            out[f"onebit.worker.{i}"], out[f"onebit.server.{i}"] = w, s
        return out


def int8_reduce_scatter(flat_grad: torch.Tensor, out: torch.Tensor, group: comm.Group, cuts: Sequence[int]) -> None:
    """The dp average of `flat_grad` (padded to a multiple of dp) over this rank's shard into `out`,
    each destination's part quantized to int8 blocks on the wire (summed in fp32). cuts: the segments'
    boundaries, which no block straddles, so a replicated parameter's gradient quantizes alike on every
    tp rank."""
    comm.quantized_reduce_scatter(out, flat_grad, group=group, cuts=cuts)
    out.div_(group.size)


def int8_all_gather(flat_param: torch.Tensor, master: torch.Tensor, group: comm.Group, cuts: Sequence[int]) -> None:
    """Every rank's exact master shard into `flat_param` as int8 blocks that break at `cuts` (the
    segments' boundaries): all ranks (this one too) compute with the same dequantized values, and tp
    ranks with the same replicated parameters."""
    comm.quantized_all_gather(flat_param, master, group=group, cuts=cuts)


def wire_formula(numel: int, world: int, cuts: int = 0, block: int = comm.INT8_BLOCK) -> dict[str, int]:
    """Bytes one rank sends per call of each compressed collective on `numel` elements (with `cuts`
    block breaks for int8: the counts comm.wire_bytes makes; tests check one against the other)."""
    _, part = comm.onebit_residual_sizes(numel, world)
    shard = numel // world
    int8_part = shard + 4 * (math.ceil(shard / block) + cuts)
    return {"onebit_all_reduce": (part // 8 + 4) * (world - 1) * 2,
            "quantized_all_gather": int8_part * (world - 1),
            "quantized_reduce_scatter": int8_part * (world - 1)}
