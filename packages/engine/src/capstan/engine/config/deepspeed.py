"""A DeepSpeed config (``ds_config.json``) as capstan config sections: ``capstan train --deepspeed FILE``.

    sections, notes = from_deepspeed("ds_config.json", world_size=8)
    cfg, _ = resolve(sections)          # or merged over a capstan config: translate(...) then resolve

Each DeepSpeed key that has an equivalent becomes that capstan key (the
table in docs/config.md, "From DeepSpeed"); every key without one is named in
`notes`, with why, and changes nothing. Batch sizes follow DeepSpeed's rule,
``train_batch_size = micro x accumulation x data-parallel ranks``: two of the
three (with the world size) give the third, and all three must agree, as
DeepSpeed checks; the error says where each number came from.

Meaning, not just names: DeepSpeed's ZeRO stages 1-2 keep parameters whole on
every rank and offload only the optimizer; capstan's offload keeps all model
states in chunks (parameters too, sharded over dp: ZeRO-3's layout), which is
what makes them fit, so ``offload_optimizer`` maps to ``memory.offload`` at
any stage, with a note. Bucket sizes in elements become ``parallel.bucket_mb``
(fp32 bytes). An ``nvme_path`` becomes ``memory.disk_dir`` with
``offload = "disk"``. A disk tier keeps ``memory.cpu_budget`` bytes of chunks
in RAM, which DeepSpeed has no key for: unset, the run chooses it from the
machine's available RAM, its ranks per node and the activations, and logs the
choice (ram_budget.py); ``--set memory.cpu_budget=8GiB`` chooses it by hand.
``offload_param.max_in_cpu`` (parameter elements DeepSpeed keeps in RAM) is not
taken for it: it counts parameters only, and DeepSpeed's examples copy its
default (1e9) without meaning a RAM budget.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .load import ConfigError

__all__ = ["data_parallel_size", "from_deepspeed", "translate_deepspeed"]

# Keys DeepSpeed reads that change nothing here, and why (named in the notes, not errors).
_IGNORED = {
    "wall_clock_breakdown": "capstan's metrics.jsonl has every step's time",
    "dump_state": "no equivalent",
    "zero_allow_untested_optimizer": "capstan's optimizer is AdamW",
    "zero_force_ds_cpu_optimizer": "capstan's offloaded optimizer is its native CPU Adam",
    "prescale_gradients": "gradients are averaged over dp in fp32",
    "gradient_predivide_factor": "gradients are averaged over dp in fp32",
    "communication_data_type": "collectives run in the gradients' dtype (fp32)",
    "memory_breakdown": "capstan reports memory per tier in every step's metrics",
    "flops_profiler": "no equivalent",
    "comms_logger": "CAPSTAN_DEBUG_COMM=1 times every collective",
    "steps_per_print": None,  # handled
}
_ZERO_IGNORED = {
    "contiguous_gradients": "gradients always live in one flat buffer or in chunks",
    "overlap_comm": "gradient reductions overlap backward by default (parallel.bucket_mb > 0)",
    "stage3_max_live_parameters": "chunks decide what stays gathered (docs/chunkmem.md)",
    "stage3_max_reuse_distance": "chunks decide what stays gathered (docs/chunkmem.md)",
    "stage3_prefetch_bucket_size": "chunks are prefetched from the warm-up trace",
    "stage3_param_persistence_threshold": "small parameters share chunks",
    "stage3_gather_16bit_weights_on_model_save": "capstan checkpoints are universal; export with "
                                                 "`capstan checkpoint export`",
    "sub_group_size": "the optimizer steps one chunk group at a time",
    "round_robin_gradients": "no equivalent",
    "reduce_scatter": "see parallel.zero2_collective",
    "allgather_partitions": "no equivalent",
    "elastic_checkpoint": "capstan checkpoints load under any layout",
    "ignore_unused_parameters": "unused parameters are handled",
}


def data_parallel_size(config: Any, overrides: Sequence[str], world_size: int) -> int:
    """The dp degree the DeepSpeed batch sizes are taken over: the world size over the tp and pp of
    `config` and its ``--set`` overrides (checked no further: the full resolve comes after)."""
    from dataclasses import replace

    from .load import parse_override, resolve

    base = resolve(config)[0]
    for text in overrides:
        section, key, value = parse_override(text)
        if section == "parallel" and key in ("dp", "tp", "pp") and isinstance(value, int):
            base = replace(base, parallel=replace(base.parallel, **{key: value}))
    return base.dp_for(world_size)


def from_deepspeed(source: str | Path | dict[str, Any], world_size: int | None = None,
                   ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Read a DeepSpeed config (a JSON file or a dict) and translate it (`translate_deepspeed`)."""
    if isinstance(source, dict):
        return translate_deepspeed(source, world_size)
    path = Path(source)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"DeepSpeed config {path} cannot be read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {path} must hold a JSON object, got {type(data).__name__}")
    return translate_deepspeed(data, world_size)


def _enabled(section: object) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def translate_deepspeed(ds: dict[str, Any], world_size: int | None = None,
                        ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """capstan config sections (for `resolve`) and the notes naming what has no equivalent."""
    out: dict[str, dict[str, Any]] = {}
    notes: list[str] = []

    def put(section: str, key: str, value: Any) -> None:
        out.setdefault(section, {})[key] = value

    for key, why in _IGNORED.items():
        if key in ds and why:
            notes.append(f"{key}: ignored ({why})")
    _batch(ds, world_size, put)
    _optimizer(ds.get("optimizer"), put, notes)
    _scheduler(ds.get("scheduler"), put, notes)
    _precision(ds, put, notes)
    _zero(ds.get("zero_optimization"), put, notes)
    if "gradient_clipping" in ds:
        put("train", "grad_clip", float(ds["gradient_clipping"]))
    if "steps_per_print" in ds:
        put("log", "every", int(ds["steps_per_print"]))
    if _enabled(ds.get("tensorboard")):
        put("log", "tensorboard", True)
        if ds["tensorboard"].get("output_path"):
            notes.append("tensorboard.output_path: TensorBoard files go to log.run_dir/tensorboard")
    if "activation_checkpointing" in ds:
        notes.append("activation_checkpointing: DeepSpeed's settings of its checkpointing API; capstan's is "
                     "memory.activation_checkpointing (the reference GPT's blocks, or capstan.tensorpar.recompute)")
    known = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
             "scheduler", "fp16", "bf16", "zero_optimization", "gradient_clipping", "steps_per_print",
             "tensorboard", "activation_checkpointing", "amp", *_IGNORED}
    for key in sorted(set(ds) - known):
        notes.append(f"{key}: no equivalent in capstan (ignored)")
    return out, notes


def _batch(ds: dict[str, Any], world_size: int | None, put: Any) -> None:
    """train_batch_size = micro x accumulation x dp, as DeepSpeed derives and checks it."""
    total, micro, accum = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                               "gradient_accumulation_steps"))
    for name, value in (("train_batch_size", total), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", accum)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"DeepSpeed {name} = {value!r} must be a positive integer")
    dp = world_size
    if total is not None and dp is not None:
        if micro is None and accum is None:
            micro, accum = total // dp, 1
        elif micro is None:
            micro = total // (accum * dp)
        elif accum is None:
            accum = total // (micro * dp)
        if not micro or not accum or micro * accum * dp != total:
            raise ConfigError(f"DeepSpeed train_batch_size = {total} is not train_micro_batch_size_per_gpu "
                              f"({micro}) x gradient_accumulation_steps ({accum}) x data-parallel ranks ({dp}, "
                              "the world size without tp/pp)")
    if micro is not None:
        put("train", "micro_batch_size", int(micro))
    if accum is not None:
        put("train", "grad_accum_steps", int(accum))


def _optimizer(opt: object, put: Any, notes: list[str]) -> None:
    if opt is None:
        return
    if not isinstance(opt, dict):
        raise ConfigError(f"DeepSpeed optimizer must be an object, got {type(opt).__name__}")
    kind = str(opt.get("type", "")).lower()
    params = opt.get("params", {}) or {}
    if kind not in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        notes.append(f"optimizer.type = {opt.get('type')!r}: capstan trains with AdamW (its hyper-parameters "
                     "below are taken where they exist)")
    elif kind == "adam" and params.get("adam_w_mode") is False and params.get("weight_decay"):
        notes.append("optimizer: Adam with L2 weight decay (adam_w_mode false) has no equivalent: capstan's "
                     "weight decay is AdamW's, decoupled")
    if "lr" in params:
        put("train", "lr", float(params["lr"]))
    betas = params.get("betas")
    if betas is not None:
        put("train", "beta1", float(betas[0]))
        put("train", "beta2", float(betas[1]))
    if "eps" in params:
        put("train", "eps", float(params["eps"]))
    if "weight_decay" in params:
        put("train", "weight_decay", float(params["weight_decay"]))
    for key in sorted(set(params) - {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"}):
        notes.append(f"optimizer.params.{key}: no equivalent (ignored)")


def _scheduler(sched: object, put: Any, notes: list[str]) -> None:
    if sched is None:
        return
    if not isinstance(sched, dict):
        raise ConfigError(f"DeepSpeed scheduler must be an object, got {type(sched).__name__}")
    kind = sched.get("type")
    p = sched.get("params", {}) or {}
    if "warmup_num_steps" in p:
        put("train", "warmup_steps", int(p["warmup_num_steps"]))
    if "warmup_max_lr" in p:
        put("train", "lr", float(p["warmup_max_lr"]))
    if "total_num_steps" in p:
        put("train", "steps", int(p["total_num_steps"]))
    if kind == "WarmupLR":
        put("train", "lr_schedule", "constant")
    elif kind == "WarmupDecayLR":
        put("train", "lr_schedule", "linear")
        put("train", "min_lr", 0.0)
    elif kind == "WarmupCosineLR":
        put("train", "lr_schedule", "cosine")
        if "cos_min_ratio" in p and "warmup_max_lr" in p:
            put("train", "min_lr", float(p["cos_min_ratio"]) * float(p["warmup_max_lr"]))
    else:
        notes.append(f"scheduler.type = {kind!r}: capstan's schedules are warmup + cosine / linear / constant "
                     "(train.lr_schedule)")
    if p.get("warmup_min_lr"):
        notes.append("scheduler.params.warmup_min_lr: capstan's warmup starts at lr / warmup_steps")
    if p.get("warmup_type") not in (None, "linear"):
        notes.append(f"scheduler.params.warmup_type = {p['warmup_type']!r}: capstan's warmup is linear")


def _precision(ds: dict[str, Any], put: Any, notes: list[str]) -> None:
    fp16, bf16 = ds.get("fp16"), ds.get("bf16")
    if _enabled(fp16) and _enabled(bf16):
        raise ConfigError("DeepSpeed fp16 and bf16 are both enabled; enable one")
    if _enabled(bf16):
        put("precision", "dtype", "bf16")
    if _enabled(fp16):
        put("precision", "dtype", "fp16")
        if fp16.get("loss_scale", 0):
            notes.append(f"fp16.loss_scale = {fp16['loss_scale']}: a static loss scale has no equivalent; capstan "
                         "scales dynamically (initial_scale, window, hysteresis, min_scale)")
        if "initial_scale_power" in fp16:
            put("precision", "initial_scale", float(2 ** int(fp16["initial_scale_power"])))
        if "loss_scale_window" in fp16:
            put("precision", "window", int(fp16["loss_scale_window"]))
        if "hysteresis" in fp16:
            put("precision", "hysteresis", int(fp16["hysteresis"]))
        if "min_loss_scale" in fp16:
            put("precision", "min_scale", float(fp16["min_loss_scale"]))
        if "raise_error_at_min_scale" in fp16:
            put("precision", "raise_at_min_scale", bool(fp16["raise_error_at_min_scale"]))
    if _enabled(ds.get("amp")):
        notes.append("amp: NVIDIA Apex AMP has no equivalent; use bf16 or fp16")


def _zero(z: object, put: Any, notes: list[str]) -> None:
    if z is None:
        return
    if not isinstance(z, dict):
        raise ConfigError(f"DeepSpeed zero_optimization must be an object, got {type(z).__name__}")
    stage = int(z.get("stage", 0))
    if not 0 <= stage <= 3:
        raise ConfigError(f"DeepSpeed zero_optimization.stage = {stage} is not 0, 1, 2 or 3")
    put("parallel", "zero_stage", stage)
    for key, why in _ZERO_IGNORED.items():
        if key in z:
            notes.append(f"zero_optimization.{key}: ignored ({why})")
    if "reduce_bucket_size" in z:
        put("parallel", "bucket_mb", float(z["reduce_bucket_size"]) * 4 / 2**20)
    if "allgather_bucket_size" in z and "reduce_bucket_size" not in z:
        put("parallel", "bucket_mb", float(z["allgather_bucket_size"]) * 4 / 2**20)
    devices = {k: (z.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
    where = "nvme" if "nvme" in devices.values() else ("cpu" if "cpu" in devices.values() else "none")
    if where == "none":
        return
    if stage < 3:
        notes.append(f"zero_optimization.offload_optimizer at stage {stage}: capstan's offload keeps all model "
                     "states in chunks (parameters too, sharded over dp as at stage 3), which is what lets them "
                     "fit in RAM and on disk")
    if where == "cpu":
        put("memory", "offload", "cpu")
        return
    put("memory", "offload", "disk")
    path = next((z[k].get("nvme_path") for k in ("offload_param", "offload_optimizer")
                 if (z.get(k) or {}).get("nvme_path")), None)
    if path:
        put("memory", "disk_dir", str(path))
    notes.append("offload to nvme: memory.cpu_budget (bytes of chunks kept in RAM per rank; DeepSpeed has no "
                 "such key) is chosen at start from this machine's available RAM, its ranks and the activations, "
                 "and logged; set it to choose, e.g. --set memory.cpu_budget=8GiB")
    for k in ("offload_optimizer", "offload_param"):
        for extra in sorted(set(z.get(k) or {}) - {"device", "nvme_path", "pin_memory"}):
            why = ("it counts parameter elements only; the RAM budget of all model states is memory.cpu_budget"
                   if extra == "max_in_cpu" else "the disk tier's I/O is capstan's own: O_DIRECT, 8 requests in flight")
            notes.append(f"zero_optimization.{k}.{extra}: ignored ({why})")
