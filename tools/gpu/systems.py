"""The measurements tools/bench_gpu.py runs, each in a subprocess of its own on the device of its config.

Every function takes the GPT config (a dict, as capstan.engine.initialize reads it; train.device names
the device) and returns a JSON-able dict: the step time (median after two warm-up steps), the parameter
count and the device's peak allocated bytes. Device calls go through torch.get_device_module, so the
same lines run on CUDA and on the CPU suite's stand-in (which bench_gpu loads in the subprocess first);
FSDP2 and DeepSpeed are CUDA-only and bench_gpu skips them elsewhere, saying why.
"""

from __future__ import annotations

import os
import time

__all__ = ["run_capstan", "run_plain", "run_fsdp", "run_deepspeed", "matmul_rate", "device_info"]


def _tokens(cfg: dict, n: int) -> list:
    import torch

    g = torch.Generator().manual_seed(0)
    m, t = cfg["model"], cfg["train"]
    return [torch.randint(0, m["vocab_size"], (t["micro_batch_size"], m["seq_len"] + 1), generator=g)
            for _ in range(n)]


def _device_setup(cfg: dict):
    """The device of `cfg` and its module (torch.cuda, torch.standin); TF32 on where it exists (CUDA)."""
    import torch

    device = torch.device(cfg["train"]["device"], 0)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    module = torch.get_device_module(device.type)
    module.init()  # torch.cuda's peak counters raise "Invalid device argument" before the device is initialized
    module.reset_peak_memory_stats(device)
    return device, module


def run_capstan(cfg: dict) -> dict:
    from capstan.engine import initialize

    device, dm = _device_setup(cfg)
    engine = initialize(config=cfg)
    batches = _tokens(cfg, cfg["train"]["steps"])
    params = sum(p.numel() for p in engine.module.parameters()) if not engine.chunked else \
        sum(h.slot.numel for h in engine.module.homes.values())
    times = []
    for b in batches:
        it = iter([(b[:, :-1], b[:, 1:])])
        dm.synchronize(device)
        t0 = time.perf_counter()
        info = engine.train_batch(it)
        dm.synchronize(device)
        times.append(time.perf_counter() - t0)
        assert info.loss == info.loss, "NaN loss"
    engine.close()
    # capstan resets the device's peak counters each step (chunkmem's DevicePeak): its allocated peak over the
    # whole run, what max_memory_allocated gives the other systems, which never reset it
    from capstan.chunkmem.memory.device import device_peak

    peak = device_peak(device).allocated_peak()
    return {"params": params, "step_s": _median(times[2:] or times), "peak_device": peak}


def run_plain(cfg: dict) -> dict:
    device, _ = _device_setup(cfg)
    model, opt = plain_model(cfg, device)
    return _torch_loop(cfg, model, opt, autocast=cfg["precision"]["dtype"] == "bf16")


def plain_model(cfg: dict, device: object) -> tuple:
    """The plain loop's model (the reference GPT of `cfg` on `device`) and its torch.optim.AdamW(fused=True)."""
    import torch

    from capstan import comm
    from capstan.engine.config import resolve
    from capstan.engine.model.models import build_reference_model

    c, _ = resolve(cfg)
    # Built on the CPU, then moved: the reference GPT's init draws from a CPU generator into tensors made
    # where it runs, which CUDA refuses (the stand-in, drawing from the CPU generator, would not show it).
    model = build_reference_model(c, comm.single_process_groups()).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)


def torch_step(model: object, opt: object, x: object, y: object, autocast: bool, phase=None) -> None:  # noqa: ANN001
    """One step of the plain torch loop: forward (bf16 autocast, or the model's own precision policy) and
    the loss, backward, clip_grad_norm_, the optimizer. `phase(name)`, a context manager around each of
    "forward", "backward" and "step" (profile_step.py labels them for the profiler)."""
    import contextlib

    import torch

    phase = phase or (lambda name: contextlib.nullcontext())
    with phase("forward"):
        with torch.autocast(x.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            out = model(x)
        loss = model.loss(out.float(), y)
    with phase("backward"):
        loss.backward()
    with phase("step"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _torch_loop(cfg: dict, model: object, opt: object, autocast: bool) -> dict:
    """Time a plain torch training loop (torch_step)."""
    device, dm = _device_setup(cfg)
    params = sum(p.numel() for p in model.parameters())
    times = []
    for b in _tokens(cfg, cfg["train"]["steps"]):
        x, y = b[:, :-1].to(device, non_blocking=True), b[:, 1:].to(device, non_blocking=True)
        dm.synchronize(device)
        t0 = time.perf_counter()
        torch_step(model, opt, x, y, autocast)
        dm.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"params": params, "step_s": _median(times[2:] or times), "peak_device": dm.max_memory_allocated(device)}


def run_fsdp(cfg: dict) -> dict:
    """FSDP2 (`fully_shard` per block and at the root) with `CPUOffloadPolicy`: parameters, gradients
    and optimizer states in pinned RAM, each block's parameters copied to the GPU for its compute,
    the optimizer stepping on the CPU; bf16 compute through `MixedPrecisionPolicy`. The optimizer is torch
    AdamW's fused CPU kernel (`fused=True`, which takes FSDP2's DTensors: checked on the CPU with gloo),
    the peer at its best: on CPU parameters torch's default is the per-tensor loop, which the first lease
    measured (docs/benchmarks.md, "GPU"). `result["optimizer"]` says which one ran."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from capstan import comm
    from capstan.engine.config import resolve
    from capstan.engine.model.models import build_reference_model

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29518"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", 0))
    c, _ = resolve(cfg)
    model = build_reference_model(c, comm.single_process_groups())
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=True),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    for layer in model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    try:
        opt, kind = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True), "fused"
    except (RuntimeError, ValueError) as exc:  # a torch whose fused kernel refuses these parameters
        opt, kind = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1), f"default ({exc})"
    result = _torch_loop(cfg, model, opt, autocast=False)  # bf16 through the MixedPrecisionPolicy
    result["optimizer"] = f"torch AdamW {kind}"
    dist.destroy_process_group()
    return result


def run_deepspeed(cfg: dict) -> dict:
    import deepspeed

    from capstan import comm
    from capstan.engine.config import resolve
    from capstan.engine.model.models import build_reference_model

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    device, dm = _device_setup(cfg)
    c, _ = resolve(cfg)
    model = build_reference_model(c, comm.single_process_groups())
    ds = {"train_micro_batch_size_per_gpu": cfg["train"]["micro_batch_size"], "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "contiguous_gradients": True, "overlap_comm": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    times = []
    for b in _tokens(cfg, cfg["train"]["steps"]):
        x, y = b[:, :-1].to(device), b[:, 1:].to(device)
        dm.synchronize(device)
        t0 = time.perf_counter()
        loss = model.loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        dm.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"params": sum(p.numel() for p in model.parameters()), "step_s": _median(times[2:] or times),
            "peak_device": dm.max_memory_allocated(device)}


def matmul_rate(cfg: dict) -> dict:
    """Dense bf16 matmul TFLOPS measured here: the denominator of the model FLOPs utilization (CUDA)."""
    import torch

    device, dm = _device_setup(cfg)
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    dm.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    dm.synchronize(device)
    return {"tflops": 10 * 2 * n**3 / (time.perf_counter() - t0) / 1e12}


def device_info(cfg: dict) -> dict:
    """The device's free and total memory, and its name (the scale search's starting estimates)."""
    import torch

    device, dm = _device_setup(cfg)
    free, total = dm.mem_get_info(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"free": free, "total": total, "name": name, "torch": torch.__version__}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")
