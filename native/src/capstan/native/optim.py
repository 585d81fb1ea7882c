"""CPUAdam: a torch.optim.Optimizer for cpu fp32 params, running libcapstan's Adam kernel.

A drop-in for torch.optim.AdamW (adamw_mode=True) or torch.optim.Adam
(adamw_mode=False) when the params live in host memory (ZeRO-Offload,
chunked fp32 master weights). Its state_dict has torch's layout: per param
`step` (a float32 scalar tensor), `exp_avg`, `exp_avg_sq`, so checkpoints load
into torch's optimizers and back.

`state_dtype=torch.bfloat16` keeps the two moments in bf16 (half their bytes),
updated in fp32 and stored with stochastic rounding (kernels.adam_update): each
step draws new bits from (step, the parameter's place in the optimizer).

Example::

    model = torch.nn.Linear(1024, 1024)
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from . import kernels

__all__ = ["CPUAdam"]


class CPUAdam(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True,
                 state_dtype: torch.dtype = torch.float32):
        if not 0.0 <= lr:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"eps must be >= 0, got {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        self.state_dtype = state_dtype
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    raise ValueError(f"CPUAdam: param {i} of a group is {p.dtype} on {p.device};"
                                     " CPUAdam needs fp32 cpu params")
                if not p.is_contiguous():
                    raise ValueError(f"CPUAdam: param {i} of a group is not contiguous")

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            # Same keys, dtypes and shapes as torch.optim.Adam's _init_group.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0  # the parameter's place in the optimizer: its own stochastic-rounding stream
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                state = self._init_state(p)
                state["step"] += 1
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                # A loaded state_dict may hold non-contiguous or other-dtype moments.
                for key in ("exp_avg", "exp_avg_sq"):
                    t = state[key]
                    if t.dtype != self.state_dtype or not t.is_contiguous() or t.device != p.device:
                        state[key] = t.to(device=p.device, dtype=self.state_dtype).contiguous()
                step = int(state["step"].item())
                kernels.adam_update(
                    p.view(-1), grad.view(-1), state["exp_avg"].view(-1),
                    state["exp_avg_sq"].view(-1), step=step, seed=(step << 24) + index,
                    lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    # a group loaded from torch.optim's state_dict has no adamw_mode
                    adamw=group.get("adamw_mode", self.defaults["adamw_mode"]))
        return loss
