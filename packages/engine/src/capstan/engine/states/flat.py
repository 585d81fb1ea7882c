"""`FlatStates`: plain tensors, with the optimizer's states in a flat buffer (zero/: ZeRO 0-2).

The model lives on the device it computes on; `ZeroOptimizer` keeps the masters (fp32, or the bf16
parameters themselves under precision.master_weights = "bf16") and Adam moments in one flat buffer
(sharded over dp with ZeRO 1-2), reduces gradients in buckets during backward and steps the whole buffer
at once."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from capstan import comm
from capstan.comm.health.procmem import peak_rss_bytes
from capstan.native import q8

from ..checkpoint.state import LocalParam, StateView, canonical_name, describe_param, param_owners, tied_alias
from ..config.schema import Config
from ..precision import master_dtype, moment_dtype
from ..zero.optimizer import ZeroOptimizer
from .base import ModelStates, UpdateScale, overflowed

__all__ = ["FlatStates", "FlatView"]

log = comm.get_logger("capstan.engine.engine")


class FlatStates(ModelStates):
    chunked = False

    def __init__(self, model: nn.Module, config: Config, groups: comm.Groups, device: torch.device,
                 pipeline: object | None, reference_model: bool) -> None:
        self.config = config
        self.module = model.to(device)  # parameters, and so the flat buffers and Adam, on the device
        p = config.parallel
        overlap = p.overlap_param_gather
        if overlap is None:  # auto: on for the reference GPT, whose parameters are used by their own modules
            overlap = reference_model
        bucket_bytes = int(p.bucket_mb * 2**20)
        gather_bytes = bucket_bytes if overlap else 0
        # Under pp one schedule runs every micro-batch's backward, then after_backward: a bucket starts once
        # its parameters got all their micro-batches' gradients, during the schedule's last backwards; tied
        # weights wait for the schedule's sum over their stages.
        accum = config.train.grad_accum_steps
        micro, late = (accum, list(pipeline.executor.tied_params.values())) if pipeline else (0, [])  # type: ignore[attr-defined]
        # Compression acts on the dp (x cp) axis: with one replica there is nothing to send.
        compression = p.compression if groups.replicas.size > 1 else "none"
        self.optimizer = ZeroOptimizer(model, groups, p.zero_stage, config.train, bucket_bytes, p.zero2_collective,
                                       gather_bytes, micro, late, compression=compression,
                                       freeze_steps=p.compression_freeze_steps, moment_dtype=moment_dtype(config),
                                       master_dtype=master_dtype(config))
        comm.reset_wire_bytes()
        # state_dict() between steps must see every rank's updated parameters.
        model.register_state_dict_pre_hook(lambda *args, **kwargs: self.optimizer.wait_params())

    def begin_step(self) -> None:
        pass

    def backward(self, scaled: torch.Tensor, completes_step: bool, lr: float, scale: float | None) -> None:
        scaled.backward()
        self.optimizer.after_backward()

    def pipeline_step(self, run: Callable[[], torch.Tensor], arrivals: int, lr: float,
                      scale: float | None) -> torch.Tensor:
        loss = run()
        self.optimizer.after_backward()  # gradients of the whole mean loss are in the flat buffer
        return loss

    def step(self, info: object, scale: float | None, update_scale: UpdateScale) -> None:
        opt, t = self.optimizer, self.config.train
        opt.reduce_gradients()
        s = scale if scale is not None else 1.0
        info.loss_scale = s  # type: ignore[attr-defined]
        if scale is not None and opt.has_overflow():
            where = overflowed(opt.nonfinite_params())
            update_scale(True, info.step, where)  # type: ignore[attr-defined]
            info.skipped, info.grad_norm = True, float("inf")  # type: ignore[attr-defined]
            log.info("step %d: fp16 gradients overflowed at loss scale %g%s; step skipped",
                     info.step, s, where)  # type: ignore[attr-defined]
            opt.zero_grad()
            return
        norm = opt.grad_norm() / s
        info.grad_norm = norm  # type: ignore[attr-defined]
        clip = 1.0
        if t.grad_clip and norm > t.grad_clip:
            clip = t.grad_clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
        opt.step(info.lr, clip / s)  # type: ignore[attr-defined]
        opt.zero_grad()
        if scale is not None:
            update_scale(False, info.step, "")  # type: ignore[attr-defined]

    def eval_context(self) -> AbstractContextManager[None]:
        return nullcontext()

    def stats(self, device: torch.device) -> dict[str, float]:
        opt = self.optimizer
        held = opt.state_bytes()  # fixed-size buffers: held is also the peak
        tier = device.type  # the model states live where the model computes
        # (ZeRO 2's packed buckets come and go: the peak counts the most of them alive at once)
        peak = held + (opt.overlap.held_peak if opt.overlap is not None else 0)
        return {f"mem.{tier}.peak_bytes": peak, f"mem.{tier}.resident_bytes": held, "mem.moved_bytes": 0,
                f"mem.{tier}.grad_peak_bytes": opt.grad_bytes_peak(), "mem.process.rss_peak_bytes": peak_rss_bytes()}

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        self.optimizer.wait_params()
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def raw_module(self) -> nn.Module:
        return self.module

    def checkpoint_view(self, engine: object) -> StateView:
        return FlatView(engine)


class FlatView(StateView):
    """`ZeroOptimizer`'s flat buffers (ZeRO 0-2)."""

    def __init__(self, engine: object) -> None:
        opt = engine.optimizer
        opt.wait_params()  # the overlapped all-gather of the last step's parameters must be in place
        self.opt = opt
        g = engine.groups
        owners = param_owners(engine.module)
        self.params, self._offset = [], {}
        pos = 0
        for p in opt.params:
            local_name, owner = owners[id(p)]
            lp = describe_param(canonical_name(engine, local_name), p, tuple(p.shape), owner, g.tp.rank, g.tp.size)
            lp.alias = tied_alias(engine, lp.name)
            n = p.numel()
            lo, hi = max(pos, opt.lo), min(pos + n, opt.hi)
            writes = (lp.tp_dim is not None or g.tp.rank == 0) and (opt.stage > 0 or g.replicas.rank == 0)
            lp.own = (lo - pos, hi - pos) if writes and lo < hi else (0, 0)
            self.params.append(lp)
            self._offset[lp.name] = (pos, p)
            pos += n

    def _moment(self, field: str) -> torch.Tensor:
        return self.opt.exp_avg if field == "exp_avg" else self.opt.exp_avg_sq

    def read(self, lp: LocalParam, field: str) -> torch.Tensor:
        pos, _ = self._offset[lp.name]
        a, b = lp.own
        # A copy in RAM (the buffers are on the GPU when the model trains there).
        if field == "param":  # (int8 compression: the exact master shard, not the quantized gather)
            return self.opt.exact_param(pos + a, pos + b).to("cpu", copy=True)
        if self.opt.q8:  # 8-bit moments: their exact values (lp.own is this shard's part of the parameter)
            parts = self.opt.q8_moment(field, pos) if a < b else None
            if parts is None:
                return torch.zeros(0)
            return q8.dequantize(parts[0].cpu(), parts[1].cpu(), field, q8.BLOCK)
        return self._moment(field)[pos + a - self.opt.lo : pos + b - self.opt.lo].to("cpu", copy=True)

    def dtype(self, field: str) -> torch.dtype:
        if field == "param":  # the master as it is: fp32, or a bf16 master (precision.master_weights)
            return self.opt.master_dtype
        if self.opt.q8:  # 8-bit moments are saved as their fp32 values
            return torch.float32
        return self.opt.exp_avg.dtype

    def write(self, lp: LocalParam, field: str, local: torch.Tensor) -> None:
        pos, p = self._offset[lp.name]
        flat = local.reshape(-1)
        if field == "param":
            self.opt.flat_param[pos : pos + flat.numel()].copy_(flat)
            return
        lo, hi = max(pos, self.opt.lo), min(pos + flat.numel(), self.opt.hi)
        if lo < hi and self.opt.q8:  # rounded to nearest: the codes and scales the values came from
            codes, scales = self.opt.q8_moment(field, pos)  # type: ignore[misc]
            new_codes, new_scales = q8.quantize(flat[lo - pos : hi - pos], field, q8.BLOCK)
            codes.copy_(new_codes)
            scales.copy_(new_scales)
        elif lo < hi:
            self._moment(field)[lo - self.opt.lo : hi - self.opt.lo].copy_(flat[lo - pos : hi - pos])

    def finish_load(self) -> None:
        self.opt.after_load()

    def _local(self) -> dict[str, torch.Tensor]:
        return self.opt.onebit.state_tensors() if self.opt.onebit is not None else {}

    def local_keys(self) -> dict[str, int]:
        return {k: t.numel() for k, t in self._local().items()}

    def read_local(self, key: str) -> torch.Tensor:
        return self._local()[key].detach().reshape(-1).to("cpu", copy=True)

    def write_local(self, key: str, value: torch.Tensor) -> None:
        self._local()[key].view(-1).copy_(value.reshape(-1))

    @property  # type: ignore[override]
    def optimizer_step(self) -> int:
        return self.opt.step_count

    @optimizer_step.setter
    def optimizer_step(self, value: int) -> None:
        self.opt.step_count = value
