"""`ShardMoments`: Adam's moments of one rank's shard of the flat buffer, and the update over its pieces.

A shard is stepped a piece at a time, a piece being one segment's part of the shard (a run of parameters
with the same weight decay and tp marking: ZeroOptimizer's `Segment`). Two ways:

* fp32 parameters, gradients and moments on an accelerator with torch's fused AdamW: one multi-tensor
  call per weight decay over every piece (device_ops.adam_step_fused), where a call per piece would be a
  launch each;
* else one native kernel call per piece (the CPU's kernels, or their torch fallback on a device): fp32
  or bf16 moments, a bf16 master (stochastic rounding drawn from the step and the flat position), and
  8-bit moments.

8-bit moments (torch.uint8) keep a block scale per Q8_BLOCK values of each moment, blocks starting at each
parameter's first element in the shard, so at stage 0 (and wherever no shard boundary cuts a parameter)
they are the chunks' blocks too (chunkmem's moment_layout.py).
"""

from __future__ import annotations

import torch

from capstan.comm.job.accelerator import is_accelerator
from capstan.native import device_ops, kernels
from capstan.native.q8 import BLOCK as Q8_BLOCK

__all__ = ["ShardMoments"]


class ShardMoments:
    def __init__(self, sizes: list[int], offsets: list[int], lo: int, hi: int, pieces: list[tuple[int, int]],
                 device: torch.device, dtype: torch.dtype) -> None:
        """sizes, offsets: every parameter's elements and flat start, in buffer order; [lo, hi): the shard;
        pieces: the (start, end) flat ranges the shard steps in; dtype: the moments' (fp32, bf16, or
        torch.uint8 for 8-bit)."""
        self.lo, self.hi = lo, hi
        self.exp_avg = torch.zeros(hi - lo, device=device, dtype=dtype)
        self.exp_avg_sq = torch.zeros(hi - lo, device=device, dtype=dtype)
        self.q8 = dtype == torch.uint8
        self._q8_of: dict[int, tuple[int, int, int, int]] = {}  # flat start -> (a, b, first block, blocks)
        blocks = 0
        for n, start in zip(sizes, offsets, strict=True):
            a, b = max(start, lo), min(start + n, hi)
            if self.q8 and a < b:
                nb = kernels.q8_blocks([b - a], Q8_BLOCK)
                self._q8_of[start] = (a, b, blocks, nb)
                blocks += nb
        self.scale_m = torch.zeros(blocks, device=device) if self.q8 else None
        self.scale_v = torch.zeros(blocks, device=device) if self.q8 else None
        # per piece (a, b): its parameters' segments relative to a, and its range of scales
        self._q8_calls: dict[tuple[int, int], tuple[list[tuple[int, int, int]], int, int]] = {}
        for a, b in pieces if self.q8 else ():
            parts = [q for q in self._q8_of.values() if a <= q[0] < b]
            self._q8_calls[(a, b)] = ([(pa - a, pb - pa, pa) for pa, pb, _, _ in parts], parts[0][2],
                                      parts[-1][2] + parts[-1][3])

    def tensors(self) -> list[torch.Tensor]:
        """The moments' tensors (8-bit: their block scales too), for byte counts."""
        return [self.exp_avg, self.exp_avg_sq] + ([self.scale_m, self.scale_v] if self.q8 else [])  # type: ignore[list-item]

    def q8_moment(self, field: str, start: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """8-bit moments: the codes and block scales of `field` of the parameter at flat offset `start`
        (its part in this shard), or None where this shard holds none of it."""
        if start not in self._q8_of:
            return None
        a, b, first, nb = self._q8_of[start]
        codes, scales = ((self.exp_avg, self.scale_m) if field == "exp_avg" else (self.exp_avg_sq, self.scale_v))
        return codes[a - self.lo : b - self.lo], scales[first : first + nb]  # type: ignore[index]

    def step(self, param: torch.Tensor, grad: torch.Tensor, pieces: list[tuple[int, int, float]], *, step: int,
             lr: float, beta1: float, beta2: float, eps: float, grad_scale: float) -> None:
        """AdamW over the shard's `param` and `grad` (both [hi - lo]), piece by piece: (start, end, weight
        decay) in flat positions."""
        hp = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, adamw=True, grad_scale=grad_scale)
        if self._fused_on_device(param, grad):
            by_decay: dict[float, list[slice]] = {}
            for a, b, decay in pieces:
                by_decay.setdefault(decay, []).append(slice(a - self.lo, b - self.lo))
            for decay, slices in by_decay.items():
                device_ops.adam_step_fused([param[s] for s in slices], [grad[s] for s in slices],
                                           [self.exp_avg[s] for s in slices], [self.exp_avg_sq[s] for s in slices],
                                           weight_decay=decay, **hp)
            return
        for a, b, decay in pieces:
            sl = slice(a - self.lo, b - self.lo)
            if self.q8:
                segments, first, last = self._q8_calls[(a, b)]
                kernels.adam_update_q8(param[sl], grad[sl], self.exp_avg[sl], self.exp_avg_sq[sl],
                                       self.scale_m[first:last], self.scale_v[first:last],  # type: ignore[index]
                                       segments=segments, block=Q8_BLOCK, weight_decay=decay, seed=step, **hp)
            else:
                kernels.adam_update(param[sl], grad[sl], self.exp_avg[sl], self.exp_avg_sq[sl], index_base=a,
                                    weight_decay=decay, seed=step, **hp)

    def _fused_on_device(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """fp32 parameters, gradients and moments on an accelerator where torch's fused AdamW runs."""
        return (is_accelerator(param.device) and param.dtype == grad.dtype == torch.float32
                and self.exp_avg.dtype == torch.float32 and device_ops.fused_available(param.device))
