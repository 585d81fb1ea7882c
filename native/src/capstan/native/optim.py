"""CPUAdam: a torch.optim.Optimizer for cpu fp32 params, running libcapstan's Adam kernel.

A drop-in for torch.optim.AdamW (adamw_mode=True) or torch.optim.Adam
(adamw_mode=False) when the params live in host memory (ZeRO-Offload,
chunked fp32 master weights). Its state_dict has torch's layout: per param
`step` (a float32 scalar tensor), `exp_avg`, `exp_avg_sq`, so checkpoints load
into torch's optimizers and back.

`state_dtype=torch.bfloat16` keeps the two moments in bf16 (half their bytes),
updated in fp32 and stored with stochastic rounding (kernels.adam_update): each
step draws new bits from (step, the parameter's place in the optimizer).
`state_dtype=torch.uint8` keeps them in 8 bits, block-wise quantized
(kernels.adam_update_q8, as bitsandbytes' AdamW8bit): `exp_avg` and
`exp_avg_sq` hold the codes, `exp_avg_scale` and `exp_avg_sq_scale` one fp32
scale per block of 256 values. A state_dict of either kind loads into either
(capstan.native.q8 converts; 8-bit values come back as the same codes).

Example::

    model = torch.nn.Linear(1024, 1024)
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from . import kernels, q8

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
        if state_dtype not in (torch.float32, torch.bfloat16, torch.uint8):
            raise ValueError("state_dtype must be torch.float32, torch.bfloat16 or torch.uint8 (8-bit), "
                             f"got {state_dtype}")
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
            if self.state_dtype == torch.uint8:
                blocks = kernels.q8_blocks([p.numel()], q8.BLOCK)
                state["exp_avg_scale"], state["exp_avg_sq_scale"] = torch.zeros(blocks), torch.zeros(blocks)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's load casts every state tensor of a floating parameter to the parameter's dtype,
        which would turn 8-bit codes into floats of their code numbers: keep those as they are."""
        codes = {pid: {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and v.dtype == torch.uint8}
                 for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(ids, params):
            for key, value in codes.get(pid, {}).items():
                self.state[p][key] = value.clone()

    def _convert_moments(self, p: torch.Tensor, state: dict) -> None:
        """A loaded state_dict may hold moments in another format, non-contiguous or elsewhere: make them
        what this optimizer keeps (8-bit ones go through their exact fp32 values, q8)."""
        for key in ("exp_avg", "exp_avg_sq"):
            t, scale = state[key], state.get(f"{key}_scale")
            if t.dtype == torch.uint8 and scale is not None and self.state_dtype != torch.uint8:
                t = q8.dequantize(t.cpu().contiguous(), scale.cpu().float(), key, q8.BLOCK).view(p.shape)
                del state[f"{key}_scale"]
            if self.state_dtype == torch.uint8 and (t.dtype != torch.uint8 or scale is None):
                codes, scales = q8.quantize(t.to(device="cpu", dtype=torch.float32), key, q8.BLOCK)
                state[key], state[f"{key}_scale"] = codes.view(p.shape), scales
                continue
            if t.dtype != self.state_dtype or not t.is_contiguous() or t.device != p.device:
                t = t.to(device=p.device, dtype=self.state_dtype).contiguous()
            state[key] = t
            if self.state_dtype == torch.uint8:
                s = state[f"{key}_scale"]
                state[f"{key}_scale"] = s.to(device="cpu", dtype=torch.float32).contiguous()

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
                self._convert_moments(p, state)
                step = int(state["step"].item())
                args = dict(step=step, seed=(step << 24) + index, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                            eps=group["eps"], weight_decay=group["weight_decay"],
                            # a group loaded from torch.optim's state_dict has no adamw_mode
                            adamw=group.get("adamw_mode", self.defaults["adamw_mode"]))
                m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
                if self.state_dtype == torch.uint8:
                    kernels.adam_update_q8(p.view(-1), grad.view(-1), m, v, state["exp_avg_scale"],
                                           state["exp_avg_sq_scale"], block=q8.BLOCK, **args)
                else:
                    kernels.adam_update(p.view(-1), grad.view(-1), m, v, **args)
        return loss
