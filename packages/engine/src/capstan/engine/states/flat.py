"""`FlatStates`: plain tensors, with the optimizer's fp32 states in a flat buffer (zero/: ZeRO 0-2).

The model lives on the device it computes on; `ZeroOptimizer` keeps the fp32 masters and Adam moments
in one flat buffer (sharded over dp with ZeRO 1-2), reduces gradients in buckets during backward and
steps the whole buffer at once."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from capstan import comm
from capstan.comm.procmem import peak_rss_bytes

from ..config.schema import Config
from ..zero.optimizer import ZeroOptimizer
from .base import ModelStates, UpdateScale, overflowed

__all__ = ["FlatStates"]

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
                                       freeze_steps=p.compression_freeze_steps)
        comm.reset_wire_bytes()
        # state_dict() between steps must see every rank's updated parameters.
        model.register_state_dict_pre_hook(lambda *args, **kwargs: self.optimizer.wait_params())

    def begin_step(self) -> None:
        pass

    def backward(self, scaled: torch.Tensor, completes_step: bool, lr: float, scale: float) -> None:
        scaled.backward()
        self.optimizer.after_backward()

    def pipeline_step(self, run: Callable[[], torch.Tensor], arrivals: int, lr: float, scale: float) -> torch.Tensor:
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
        held = self.optimizer.state_bytes()  # fixed-size buffers: held is also the peak
        tier = device.type  # the model states live where the model computes
        return {f"mem.{tier}.peak_bytes": held, f"mem.{tier}.resident_bytes": held, "mem.moved_bytes": 0,
                "mem.process.rss_peak_bytes": peak_rss_bytes()}

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        self.optimizer.wait_params()
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def raw_module(self) -> nn.Module:
        return self.module
