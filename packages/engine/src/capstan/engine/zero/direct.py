"""`AutogradGrads`: the flat optimizer's gradients at one replica on an accelerator, left as autograd's own.

With one replica there is nothing to reduce, so a flat gradient buffer only costs: autograd adds each
gradient into its view (a kernel launch per parameter a step, and a GPU step of a small model is bound
by the host's launches), where plain PyTorch's first backward assigns them. Here the gradients stay
autograd's tensors, the norm is one multi-tensor reduction over them (clip_grad_norm_'s way), and the
step is one fused multi-tensor AdamW call per weight decay over the parameters, the gradients and views
of the flat moments in the parameters' shapes, made once (the buffers never move). ZeroOptimizer uses it
for fp32 parameters and moments where torch's fused AdamW runs (`ZeroOptimizer.direct`).
"""

from __future__ import annotations

import torch

from capstan.native import device_ops, kernels

__all__ = ["AutogradGrads"]


class AutogradGrads:
    def __init__(self, params: list[torch.Tensor], offsets: list[int], counted: list[bool], decays: list[float],
                 exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """params in the flat buffer's order, at their `offsets`; `counted`: whether each counts in the global
        norm on this rank; `decays`: each one's weight decay; exp_avg, exp_avg_sq: the flat moments."""
        self.params = params
        self.counted = [i for i, c in enumerate(counted) if c]
        self.numel = sum(p.numel() for p in params)
        # per weight decay: the parameters' indices, the parameters, and the moments' views
        self.by_decay: dict[float, tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}
        for i, (p, start, decay) in enumerate(zip(params, offsets, decays, strict=True)):
            idx, ps, ms, vs = self.by_decay.setdefault(decay, ([], [], [], []))
            n = p.numel()
            idx.append(i)
            ps.append(p.detach())
            ms.append(exp_avg[start : start + n].view_as(p))
            vs.append(exp_avg_sq[start : start + n].view_as(p))
        self._norms: list[torch.Tensor] | None = None  # this step's gradient norms (`norms`)

    def grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient, zeros where no backward reached it (what a flat buffer would hold, so
        the step is the same)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]  # type: ignore[misc]

    def norms(self) -> list[torch.Tensor]:
        """Every gradient's L2 norm (fp32, 0-dim, on the device), taken once a step: fp16's overflow check and
        the clipping norm both read them, where each used to take its own pass over every gradient. Forgotten
        after every backward and step (`forget`), when the gradients change."""
        if self._norms is None:
            grads = self.grads()
            self._norms = list(torch._foreach_norm(grads)) if grads else []
        return self._norms

    def forget(self) -> None:
        self._norms = None

    def sumsq(self, device: torch.device) -> torch.Tensor:
        """The counted gradients' squared norm, a 0-dim float64 tensor on the device (no host read)."""
        every = self.norms()
        norms = [every[i] for i in self.counted]
        if not norms:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.linalg.vector_norm(torch.stack(norms), 2, dtype=torch.float64).square()

    def nonfinite(self) -> bool:
        """Whether any gradient holds inf/NaN (one host read; a norm is inf/NaN exactly then, but for finite
        values past 1.8e19, whose square fp32 cannot hold: no gradient under a loss scale worth stepping)."""
        norms = self.norms()
        return bool(norms) and not bool(torch.stack(norms).isfinite().all())

    def nonfinite_params(self) -> list[torch.Tensor]:
        """The parameters whose gradient holds inf/NaN (after an overflow only)."""
        return [p for p, g in zip(self.params, self.grads(), strict=True) if kernels.has_nonfinite(g)]

    def step(self, *, step: int, lr: float, beta1: float, beta2: float, eps: float, grad_scale: float) -> None:
        """AdamW: one fused multi-tensor call per weight decay."""
        grads = self.grads()
        self.forget()
        for decay, (idx, ps, ms, vs) in self.by_decay.items():
            device_ops.adam_step_fused(ps, [grads[i] for i in idx], ms, vs, step=step, lr=lr, beta1=beta1,
                                       beta2=beta2, eps=eps, weight_decay=decay, adamw=True, grad_scale=grad_scale)

    @property
    def nbytes(self) -> int:
        """autograd's gradients, one per parameter, alive from backward to zero_grad (fp32)."""
        return 4 * self.numel
