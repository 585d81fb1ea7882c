"""The part of `capstan plan --calibrate` that runs under the launcher: what a launched rank sees.

    python -m capstan.engine.plan.probe OUT.json [SHAPES.json]   # under mpirun -np N (calibrate.py starts it)

Every rank starts comm as `capstan train` does (MPI under mpirun), then rank 0 writes to OUT.json:

* `threads`: torch's threads per rank under the launcher, and `rss`: the largest resident set of a
  rank before any model exists (interpreter, torch, MPI, capstan: `Rates.host_overhead`);
* `all_reduce`, `all_gather`, `all_to_all`: median seconds per call of capstan.comm on fp32 tensors
  of 4 KiB to 16 MiB, the slowest rank's (each call after a barrier);
* `p2p` (2 ranks): median seconds of a send from rank 0 to rank 1 and back, halved;
* `block_together` (cores >= ranks): a block's forward and backward with every rank running it at
  once; calibrate.py divides it by the same alone (`Rates.contention`);
* `layers` (cores >= ranks, SHAPES.json given: a list of {"shape": ModelShape fields, "layout": Layout
  fields}): each model's layers profiled on every rank at once (costs.measure_layers), the slowest
  rank's figures, under the profile names of `costs.layer_key(..., busy=N)`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _timed(fn, reps: int) -> float:  # noqa: ANN001
    from capstan import comm

    times = []
    for _ in range(reps):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
    comm.all_reduce(worst, "max")
    return float(worst.item())


def block_seconds(reps: int = 5) -> float:
    """A 512-wide block's forward and backward (8 x 128 tokens) at this rank's threads."""
    from capstan.comm.job.groups import Group
    from capstan.tensorpar import GPTConfig
    from capstan.tensorpar.modules.gpt import gpt_layer_factories

    from .costs import _local_collectives, _median_seconds

    cfg = GPTConfig(vocab_size=256, seq_len=128, d_model=512, n_heads=8, n_layers=1, dropout=0.0)
    with _local_collectives():
        block = gpt_layer_factories(cfg, Group("tp", (0,), 0), 0)[1]()
        x = torch.randn(8, 128, 512, requires_grad=True)
        return _median_seconds(lambda: block(x).sum().backward(), least=reps, most=reps)


def main(out: str, shapes_file: str | None = None) -> None:
    # The process imported capstan.engine.run.trainer first, as `capstan train` does (calibrate._launch_probe).
    from capstan import comm

    world = comm.init()
    n, rank = world.size, world.rank
    rss = torch.tensor([_vm_rss()], dtype=torch.float64)
    comm.all_reduce(rss, "max")
    result: dict = {"ranks": n, "threads": torch.get_num_threads(), "rss": int(rss.item()),
                    "trainer_imported": "capstan.engine.run.trainer" in sys.modules,  # the baseline's premise
                    "all_reduce": {}, "all_gather": {}, "all_to_all": {}}
    for size in SIZES:
        elems = size // 4
        reps = max(5, min(60, int(4e7 // size)))
        t = torch.ones(elems)
        out_t = torch.empty(elems * n)
        result["all_reduce"][size] = _timed(lambda t=t: comm.all_reduce(t), reps)
        result["all_gather"][size] = _timed(lambda t=t, o=out_t: comm.all_gather(o, t), reps)
        if elems % n == 0:
            back = torch.empty_like(t)
            result["all_to_all"][size] = _timed(lambda t=t, o=back: comm.all_to_all(o, t), reps)
    if n == 2:
        result["p2p"] = {}
        for size in SIZES:
            t = torch.ones(size // 4)

            def ping(t: torch.Tensor = t) -> None:
                if rank == 0:
                    comm.send(t, 1)
                    comm.recv(t, 1)
                else:
                    comm.recv(t, 0)
                    comm.send(t, 0)

            result["p2p"][size] = _timed(ping, max(5, min(40, int(2e7 // size)))) / 2
    if len(os.sched_getaffinity(0)) >= n > 1:  # every core runs a rank: calibrate.py has the block alone
        comm.barrier()
        together = torch.tensor([block_seconds()], dtype=torch.float64)
        comm.all_reduce(together, "max")
        result["block_together"] = float(together.item())
        if shapes_file:
            result["layers"] = _busy_layers(shapes_file, n)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _busy_layers(shapes_file: str, n: int) -> dict:
    from capstan import comm

    from .costs import KINDS, layer_key, measure_layers
    from .spec import Layout, ModelShape

    out = {}
    threads = torch.get_num_threads()
    for item in json.loads(open(shapes_file).read()):
        shape, layout = ModelShape(**item["shape"]), Layout(**item["layout"])
        comm.barrier()
        costs = measure_layers(shape, layout, threads)
        flat = torch.tensor([x for k in KINDS for x in (costs[k].forward, costs[k].backward)], dtype=torch.float64)
        comm.all_reduce(flat, "max")
        for j, kind in enumerate(KINDS):
            out[layer_key(kind, shape, layout, threads, busy=n)] = {"forward": float(flat[2 * j]),
                                                                   "backward": float(flat[2 * j + 1])}
    return out

