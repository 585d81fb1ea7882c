"""What a training process holds besides its model, measured: `capstan plan --calibrate` runs this alone.

    python -m capstan.engine.plan.overhead     # prints one JSON object

A rank's resident memory is more than its tensors, and on a CPU the part that is not tensors is large
next to a small model. Measured in a fresh interpreter, in this order, as the growth of its peak
resident memory (VmHWM) over what the imports of `capstan train` left:

* `first_compute`: a tiny model's first steps through the engine (the compute library's kernels and
  scratch, torch's allocator arenas);
* `bf16`: the same in bf16 (its kernels and autocast caches);
* `heavy`: the same with activation checkpointing, whose first use (like the first model built on
  the meta device, which chunked memory does) imports a large part of torch (functorch, fx, the meta
  registrations, sympy): one cost for either or both;
* `step_overhead_s` (seconds, not bytes): what a step of the tiny model takes beyond its layers'
  profiled forward and backward: the engine's per-step work (loss reduction, optimizer dispatch,
  Python), which the step-time model adds once per step.
"""

from __future__ import annotations

import json
import os
import sys

import torch

__all__ = ["measure"]


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


TINY = {"n_layers": 1, "d_model": 64, "n_heads": 4, "seq_len": 32}


def _tiny_steps(steps: int = 2, **sections: dict) -> list[float]:
    """A tiny reference GPT's steps through the engine (one process); their seconds."""
    from capstan import comm
    from capstan.engine import initialize

    cfg = {"model": dict(TINY), "train": {"micro_batch_size": 2, "steps": steps + 1, "warmup_steps": 1}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    engine = initialize(config=cfg, groups=comm.single_process_groups())
    ids = torch.randint(0, 256, (2, 33))
    seconds = []
    for _ in range(steps):
        engine.backward(engine((ids[:, :-1], ids[:, 1:])))
        seconds.append(engine.step().seconds)  # type: ignore[union-attr]
    engine.close()
    return seconds


def _step_overhead(threads: int) -> float:
    """Seconds a step of the engine takes beyond its layers' forward and backward and its optimizer: the
    engine's own bookkeeping per step (the loss reduction, hooks, Python), from the tiny model."""
    import statistics

    from .costs import measure_layers
    from .spec import Layout, ModelShape

    step = statistics.median(_tiny_steps(steps=30)[5:])
    shape = ModelShape(layers=1, hidden=TINY["d_model"], heads=TINY["n_heads"], vocab=256, seq=TINY["seq_len"])
    costs = measure_layers(shape, Layout(micro=2), threads)
    return max(0.0, step - sum(c.forward + c.backward for c in costs.values()))


def measure(threads: int = 1) -> dict[str, float]:
    """The module docstring's figures: bytes, and step_overhead_s in seconds."""
    import capstan.engine.run.trainer  # noqa: F401  what `capstan train` imports before any model

    torch.set_num_threads(threads)
    out: dict[str, float] = {}
    base = _hwm()
    _tiny_steps()
    out["first_compute"] = _hwm() - base
    base = _hwm()
    _tiny_steps(precision={"dtype": "bf16"})
    out["bf16"] = _hwm() - base
    base = _hwm()
    _tiny_steps(memory={"activation_checkpointing": True})
    out["heavy"] = _hwm() - base
    out["step_overhead_s"] = _step_overhead(threads)
    return out


if __name__ == "__main__":
    os.environ.pop("CAPSTAN_RENDEZVOUS_FILE", None)
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 1)))
