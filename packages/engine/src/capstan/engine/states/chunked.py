"""`ChunkedStates`: the model states in capstan.chunkmem's chunks (memory.offload, or ZeRO-3 over dp).

Parameters, gradients, fp32 masters and Adam moments live in chunks that a `ChunkManager` places in
RAM within memory.cpu_budget, on disk, and (on a GPU) parameter and gradient chunks on the device
within memory.gpu_budget; `ChunkAdam` steps them on the CPU, overlapped with backward where it can
(memory.overlap_optimizer). Over dp the chunks are sharded (ZeRO-3, `ShardedChunkedModel`), or
replicated under 1-bit Adam (`ReplicatedChunkedModel`, `OneBitChunkAdam`). The gradient norm is
weighted per (tp-sliced?, decayed?) chunk list and reduced over tp and pp.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from capstan import comm
from capstan.comm.health.procmem import peak_rss_bytes
from capstan.comm.job.accelerator import device_module, is_accelerator

from ..checkpoint.state import LocalParam, StateView, canonical_name, describe_param, param_owners, tied_alias
from ..config.load import ConfigError
from ..config.schema import Config
from ..machine.ram_budget import disk_room, ram_room
from ..machine.room import check_room_for_states, device_param_bytes, resident_param_bytes
from ..precision import master_dtype, moment_dtype
from ..zero.optimizer import group_order
from .base import ModelStates, UpdateScale, overflowed

__all__ = ["ChunkedStates", "ChunkView", "gpu_chunk_limit", "buffers_to", "GPU_SHARE", "GPU_WARMUP_SHARE"]

log = comm.get_logger("capstan.engine.engine")

GPU_SHARE = 0.9  # of the GPU memory free at start that chunks and activations may use (the rest: CUDA's own)
GPU_WARMUP_SHARE = 5  # the warm-up step keeps chunks within 1/5 of that while it measures the activations


def gpu_chunk_limit(device: torch.device) -> int:
    """Bytes this rank's chunks and activations may use on its device without memory.gpu_budget: 90% of
    what is free at start, shared evenly by the ranks of this node that share the device."""
    module = device_module(device)
    free, _ = module.mem_get_info(device)
    sharing = 1
    if comm.is_initialized():
        local = comm.launch().local_world_size
        sharing = -(-local // max(1, module.device_count()))
    return int(free * GPU_SHARE / sharing)


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Module buffers (causal masks, BatchNorm statistics, rotary caches) where forward runs. Chunked memory
    moves parameters only, so without this a model whose forward reads a buffer mixes a CPU tensor into
    device work on its first step."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)


class ChunkedStates(ModelStates):
    chunked = True

    def __init__(self, model: nn.Module, config: Config, groups: comm.Groups, device: torch.device,
                 pipeline: object | None,
                 init_fn: Callable[[nn.Module], None] | None = None) -> None:
        """Model states into chunkmem; a meta-device `model` is materialized module by module into its
        chunks (by `init_fn`, else each module's reset_parameters)."""
        from capstan.chunkmem import (
            AdamGroup,
            ChunkAdam,
            ChunkedModel,
            ChunkManager,
            DiskStore,
            OneBitChunkAdam,
            ReplicatedChunkedModel,
            ShardedChunkedModel,
        )

        self.config, self.groups, self.device, self.pipeline = config, groups, device, pipeline
        self.stepping = False  # between begin_step and the step's end
        self._disk_peak = 0
        mem, t = config.memory, config.train
        # On a GPU, parameter (and gradient) chunks compute there within memory.gpu_budget; masters and
        # Adam moments stay in RAM / on disk, where the native CPU Adam steps them (chunkmem/memory/device.py).
        gpu = device if is_accelerator(device) else None
        budget, limit, measure = (mem.gpu_budget, None, None) if gpu is not None else (None, None, None)
        if gpu is not None and budget is None:  # derived from the GPU and the activations the warm-up measures
            from capstan.chunkmem.memory.device import device_peak

            limit = gpu_chunk_limit(gpu)
            budget, measure = limit // GPU_WARMUP_SHARE, device_peak(gpu).moment
        # States past the machine's RAM and disk fail here, on every rank, not when the disk fills during a
        # first step (machine/room.py; with a cpu budget: the budget against this rank's share of the model
        # being trained, which the config check sized only where one rank holds the whole reference GPT)
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        replicas = groups.replicas.size
        sharded = replicas > 1 and config.parallel.compression != "onebit"
        onebit_replicas = replicas if replicas > 1 and config.parallel.compression == "onebit" else 0
        if sharded:  # ZeRO-3: this rank's 1/dp
            params = -(-params // groups.replicas.size)
        overlap, overlap_error = False, None
        try:  # (a rank that cannot overlap as asked says so in the same collective: a tied pipeline stage)
            overlap = self._overlap_optimizer()
        except ConfigError as e:
            overlap_error = str(e)
        check_room_for_states(config, groups, params, resident_param_bytes(model),
                              device_param_bytes(config, params, limit or budget) if gpu is not None else 0,
                              sharded=sharded, onebit_replicas=onebit_replicas, overlap=overlap,
                              overlap_error=overlap_error)
        disk = DiskStore(mem.disk_dir, rank=groups.world.rank) if mem.offload == "disk" else None
        self.manager = ChunkManager(mem.cpu_budget, disk, eviction=mem.eviction, memory_limit=mem.ram_limit,
                                    device=gpu, device_budget=budget, device_limit=limit, device_measure=measure)
        named = dict(model.named_parameters())
        names = [n for n, p in named.items() if p.requires_grad]
        # One chunk list per (tp-sliced?, decayed?), as zero/optimizer.py's segments: each list has one set of
        # Adam hyper-parameters and one weight in the global gradient norm. Replicated parameters
        # (tp_dim None: identical on every tp rank) count on tp rank 0 only, sliced ones on every
        # tp rank; the sum then runs over tp and pp (stages hold disjoint parameters).
        # A tied weight's copy on a higher pipeline stage (zero.is_stage_copy) gets weight 0 in the norm.
        param_groups, adam, weights = [], [], []
        classes: dict[tuple[bool, bool, bool], list[str]] = {}
        for n in names:
            classes.setdefault(group_order(named[n]), []).append(n)
        for key in sorted(classes):  # the flat buffer's order (zero/optimizer.py group_order)
            replicated, no_decay, copy = key
            sliced, decay = not replicated, not no_decay
            param_groups.append(classes[key])
            adam.append(AdamGroup(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                  weight_decay=t.weight_decay if decay else 0.0))
            weights.append(1.0 if (sliced or groups.tp.rank == 0) and not copy else 0.0)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.precision.dtype]
        kwargs = dict(param_groups=param_groups, dtype=dtype, accumulate_grads=t.grad_accum_steps > 1,
                      norm_weights=weights, outer_groups=(groups.tp, groups.pp), init_fn=init_fn,
                      moment_dtype=moment_dtype(config), master_dtype=master_dtype(config))
        if mem.chunk_order == "trace":  # one forward on a dummy batch of token ids decides the packing order
            tokens = config.model.seq_len // groups.cp.size  # this rank's tokens under cp
            dummy = torch.zeros(t.micro_batch_size, tokens, dtype=torch.long)
            kwargs.update(order="trace", example_inputs=(dummy,))
        p, replicas = config.parallel, groups.replicas
        if replicas.size > 1 and p.compression == "onebit":  # every rank the whole momentum: replicated chunks
            self.module = ReplicatedChunkedModel(model, self.manager, mem.chunk_size, group=replicas, onebit=True,
                                                 **kwargs)
            self.optimizer = OneBitChunkAdam(self.module, groups=adam, freeze_steps=p.compression_freeze_steps)
        else:
            if replicas.size > 1:  # ZeRO-3 through chunks: each dp (x cp) rank owns 1/dp of them
                self.module = ShardedChunkedModel(model, self.manager, mem.chunk_size, group=replicas,
                                                  quantized=p.compression == "int8", **kwargs)
            else:
                self.module = ChunkedModel(model, self.manager, mem.chunk_size, report_grads=overlap, **kwargs)
            room = (lambda: disk_room(mem.disk_dir)) if disk is not None else None
            self.optimizer = ChunkAdam(self.module, groups=adam, overlap=overlap, copy_room=ram_room, disk_room=room)
        comm.reset_wire_bytes()
        if gpu is not None:
            buffers_to(model, gpu)

    def _overlap_optimizer(self) -> bool:
        """memory.overlap_optimizer: on where asked (and possible); by default where chunks compute on a GPU,
        and past RAM (a cpu budget or the disk tier), where the step streams (chunkmem's overlap.py): the
        1.81B disk step took 0.74x the time without clipping, 0.90x with it (docs/benchmarks.md)."""
        mem, replicas = self.config.memory, self.groups.replicas
        why = None
        if replicas.size > 1 and self.config.parallel.compression == "onebit":
            why = "1-bit Adam averages the momentum after backward"
        elif replicas.size > 1:
            why = f"dp = {replicas.size} shards the chunks (ZeRO-3), and sharded gradients reach their owners late"
        elif self.pipeline is not None and self.pipeline.executor.tied_params:  # type: ignore[attr-defined]
            why = "weights tied across pipeline stages get their gradients summed after backward"
        if mem.overlap_optimizer and why is not None:
            raise ConfigError(f"memory.overlap_optimizer = true cannot overlap the step here: {why}")
        if mem.overlap_optimizer is None:
            past_ram = mem.cpu_budget is not None or mem.offload == "disk"
            return why is None and (is_accelerator(self.device) or past_ram)
        return bool(mem.overlap_optimizer)

    def _arm(self, lr: float, scale: float | None, arrivals: int = 1) -> None:
        """Before the backward that completes this step's gradients: the overlapped optimizer steps each
        chunk group as its gradients complete, with this step's learning rate, clip and loss scale."""
        if getattr(self.optimizer, "speculation", None) is None:
            return
        for group in self.optimizer.groups:  # type: ignore[attr-defined]
            group.lr = lr
        self.optimizer.arm(grad_clip=self.config.train.grad_clip or None,  # type: ignore[attr-defined]
                           loss_scale=scale if scale is not None else 1.0, check_overflow=scale is not None,
                           arrivals=arrivals)

    def begin_step(self) -> None:
        if not self.stepping:
            self.manager.begin_step()
            self.stepping = True

    def backward(self, scaled: torch.Tensor, completes_step: bool, lr: float, scale: float | None) -> None:
        if completes_step:
            self._arm(lr, scale)
        self.module.backward(scaled)  # type: ignore[attr-defined]

    def pipeline_step(self, run: Callable[[], torch.Tensor], arrivals: int, lr: float,
                      scale: float | None) -> torch.Tensor:
        # The executor calls this stage's modules itself, so the chunk hooks fetch parameters; the
        # saved-tensor hooks must be active around its forwards, and the end of backward (release,
        # gradient reductions of sharded chunks) runs once after its last backward.
        self.begin_step()
        self._arm(lr, scale, arrivals=arrivals)  # one schedule runs every micro-batch's backward
        with self.module.saved_tensors():  # type: ignore[attr-defined]
            loss = run()
        self.module.finish_backward()  # type: ignore[attr-defined]
        return loss

    def step(self, info: object, scale: float | None, update_scale: UpdateScale) -> None:
        opt = self.optimizer
        for group in opt.groups:  # type: ignore[attr-defined]
            group.lr = info.lr  # type: ignore[attr-defined]
        s = scale if scale is not None else 1.0
        info.loss_scale = s  # type: ignore[attr-defined]
        clip = self.config.train.grad_clip or None
        if clip is None and not opt.armed:  # type: ignore[attr-defined]  # (the overlapped step returns the norm)
            info.grad_norm = opt.grad_norm() / s  # type: ignore[attr-defined]
        norm, overflow = opt.step(grad_clip=clip, loss_scale=s, check_overflow=scale is not None)  # type: ignore[attr-defined]
        if norm is not None:
            info.grad_norm = float(norm)  # type: ignore[attr-defined]
        where = overflowed(opt.overflowed) if overflow else ""  # type: ignore[attr-defined]
        if scale is not None:
            update_scale(overflow, info.step, where)  # type: ignore[attr-defined]
        if overflow:
            info.skipped, info.grad_norm = True, float("inf")  # type: ignore[attr-defined]
            log.info("step %d: fp16 gradients overflowed at loss scale %g%s; step skipped",
                     info.step, s, where)  # type: ignore[attr-defined]
        self.manager.end_step()
        self.stepping = False

    def eval_context(self) -> AbstractContextManager[None]:
        # between steps: chunk accesses stay out of the trace and leave the moment at the next step's start
        self.flush_pending()  # (the updates a measuring step left to the next forward: chunkmem's adam.py)
        return self.manager.off_trace()

    def flush_pending(self) -> None:
        """Run the updates a step left to the next forward (chunkmem's adam.py, "Deferred update"), outside
        the trace, before anything reads the states between steps."""
        if getattr(self.optimizer, "pending", None):
            with self.manager.off_trace():
                self.optimizer.flush_pending()  # type: ignore[attr-defined]

    def stats(self, device: torch.device) -> dict[str, float]:
        s = self.manager.stats()
        disk = s["disk"]["resident_bytes"]  # type: ignore[index]
        self._disk_peak = max(self._disk_peak, disk)
        out = {"mem.cpu.peak_bytes": s["cpu"]["peak_bytes"],  # type: ignore[index]
               "mem.cpu.resident_bytes": s["cpu"]["resident_bytes"],  # type: ignore[index]
               "mem.cpu.pooled_bytes": s["cpu"]["pooled_bytes"],  # type: ignore[index]  # freed, kept for reuse
               "mem.disk.peak_bytes": self._disk_peak, "mem.disk.resident_bytes": disk,
               "mem.disk.file_bytes": s["disk"]["file_bytes"],  # type: ignore[index]  # with second slots
               "mem.moved_bytes": s["moved_bytes"], "mem.stall_s": s["stall_s"],  # type: ignore[dict-item]
               "mem.process.rss_peak_bytes": peak_rss_bytes()}
        if device.type in s:  # chunks on the GPU (their bytes, within memory.gpu_budget)
            out[f"mem.{device.type}.peak_bytes"] = s[device.type]["peak_bytes"]  # type: ignore[index]
            out[f"mem.{device.type}.resident_bytes"] = s[device.type]["resident_bytes"]  # type: ignore[index]
        return out

    def disk_file_bytes(self) -> int:
        disk = self.manager.disk
        return disk.nbytes() if disk is not None else 0  # (slots are never freed: the file only grows)

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        self.flush_pending()
        return self.module.state_tensors()  # type: ignore[attr-defined]  # one chunk at a time

    def raw_module(self) -> nn.Module:
        return getattr(self.module, "module", self.module)

    def checkpoint_view(self, engine: object) -> StateView:
        self.flush_pending()  # a checkpoint holds the states after the step's update
        return ChunkView(engine)

    def describe(self) -> str:
        return f" | chunks of {self.module.chunk_size} elements"  # type: ignore[attr-defined]

    def ram_timeline(self) -> tuple[list, int] | None:
        timeline = list(self.manager.cpu.stats.timeline)
        states = sum(e.chunk.nbytes for e in self.manager.entries.values())
        return timeline, states

    def close(self) -> None:
        speculation = getattr(self.optimizer, "speculation", None)
        if speculation is not None:
            speculation.close()
        self.manager.close()


class ChunkView(StateView):
    """A `ChunkedModel` / `ShardedChunkedModel` / `ReplicatedChunkedModel` with its `ChunkAdam`
    (ZeRO-3, offload; `OneBitChunkAdam`'s residual chunks are this rank's local state)."""

    def __init__(self, engine: object) -> None:
        from capstan.chunkmem import OneBitChunkAdam, ReplicatedChunkedModel
        from capstan.chunkmem.model.state_io import owned_homes

        self.model, self.opt = engine.module, engine.optimizer
        self._onebit = self.opt if isinstance(self.opt, OneBitChunkAdam) else None
        g = engine.groups
        owners = param_owners(engine.states.raw_module())
        mine = {id(h.param) for h in owned_homes(self.model)}
        # Replicated chunks (1-bit Adam): every dp rank holds everything, dp rank 0 writes (as ZeRO 0).
        writes = not isinstance(self.model, ReplicatedChunkedModel) or g.replicas.rank == 0
        self.params, self._homes = [], {}
        for home in self.model.homes.values():
            _, owner = owners[id(home.param)]
            lp = describe_param(canonical_name(engine, home.name), home.param, tuple(home.slot.shape), owner, g.tp.rank,
                           g.tp.size)
            lp.alias = tied_alias(engine, lp.name)
            if writes and id(home.param) in mine and (lp.tp_dim is not None or g.tp.rank == 0):
                lp.own = (0, lp.numel)
            self.params.append(lp)
            self._homes[lp.name] = (home, id(home.param) in mine)

    def read(self, lp: LocalParam, field: str) -> torch.Tensor:
        from capstan.chunkmem.model.state_io import read_state

        home, _ = self._homes[lp.name]
        return read_state(self.model, home, field).reshape(-1)[lp.own[0] : lp.own[1]]

    def dtype(self, field: str) -> torch.dtype:
        # 8-bit moments are saved as their exact fp32 values (chunkmem's state_io)
        if field == "param":  # the master as it is: fp32, or a bf16 master
            return self.model.master_dtype
        return torch.float32 if self.model.q8 else self.model.moment_dtype

    def write(self, lp: LocalParam, field: str, local: torch.Tensor) -> None:
        from capstan.chunkmem.model.state_io import write_state

        home, owned = self._homes[lp.name]
        if owned:
            write_state(self.model, home, field, local.reshape(home.slot.shape))

    def finish_load(self) -> None:
        drop = getattr(self.model, "drop_remote", None)
        if drop is not None:
            drop()  # gathered copies of remote chunks predate the load

    def local_keys(self) -> dict[str, int]:
        if self._onebit is None:
            return {}
        return {k: n for k, (_, n) in self._onebit.state_chunks().items()}

    def read_local(self, key: str) -> torch.Tensor:
        return self._onebit.read_state(key)  # type: ignore[union-attr]

    def write_local(self, key: str, value: torch.Tensor) -> None:
        self._onebit.write_state(key, value)  # type: ignore[union-attr]

    @property  # type: ignore[override]
    def optimizer_step(self) -> int:
        return self.opt.groups[0].step

    @optimizer_step.setter
    def optimizer_step(self, value: int) -> None:
        for group in self.opt.groups:
            group.step = value
