"""`capstan plan --calibrate`: measure this machine's rates and save them as a machine file.

    machine = calibrate(disk_dir="runs/calibrate", shapes=[(shape, layout)])   # about a minute
    save_machine(machine, default_machine_path())

What it measures, each with the threads a rank gets under the launcher (`probe.py` reports them):

* under `mpirun -np 2` and `-np 4` (probe.py): capstan.comm's all-reduce and all-gather from 4 KiB
  to 16 MiB (latency from the smallest, bus bandwidth from the largest), point-to-point, the
  threads and resident memory of a launched rank before its model, and a block's compute with
  every core busy (over the same alone: `Rates.contention`);
* in this process: a 512-wide block's forward and backward (its FLOP/s, for shapes not profiled),
  memory copy bandwidth, the native AdamW step (fp32; fused with the 16-bit cast; the squared-norm
  pass for clipping) in parameters per second, the compressed collectives' local work per
  parameter (1-bit Adam's step, int8's quantizing), chunkmem's access + release of a resident chunk,
  and direct-I/O write and read of 256 MiB in requests of 1 MiB (the disk tier's: one chunk at a
  time) in `disk_dir`;
* the layer profiles of the models given (costs.measure_layers), so the planner's prediction for a
  configuration needs no measurement later.

Every figure is a median of several runs; the machine file records them with the date.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .costs import block_flops, layer_costs
from .memory import runtime_family
from .probe import block_seconds
from .rates import LayerCost, Link, Rates
from .spec import Layout, Machine, ModelShape, PlanError, local_machine

__all__ = ["calibrate", "default_machine_path", "cached_machine"]

DISK_BYTES = 256 << 20
DISK_BLOCK = 1 << 20


def default_machine_path() -> Path:
    """Where `capstan plan --calibrate` keeps this machine's file unless told otherwise."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "capstan" / "machine.json"


def cached_machine() -> Machine | None:
    """This machine as last calibrated, if it was (the default path), else None."""
    from .spec import load_machine

    path = default_machine_path()
    return load_machine(path) if path.exists() else None


def _fit(times: dict, factor: float) -> Link:
    """latency + wire / bandwidth through the smallest and the largest size (wire = size x factor)."""
    points = sorted((int(size), t) for size, t in times.items())
    (small, t_small), (large, t_large) = points[0], points[-1]
    bandwidth = (large - small) * factor / max(t_large - t_small, 1e-9)
    return Link(latency=max(t_small - small * factor / bandwidth, 1e-7), bandwidth=bandwidth)


def _launch_probe(ranks: int, shapes: list[tuple[ModelShape, Layout]] = ()) -> dict:
    from ..run.mpirun import build_command, find_mpirun

    if find_mpirun() is None:
        raise PlanError("capstan plan --calibrate needs mpirun to measure collectives (capstan info says which)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        # The probe's process imports what `capstan train` imports before any model (its RSS is the baseline
        # the planner adds to), so the trainer is imported here, in that process: probe.py itself needs none
        # of it, and importing it there would close a circle plan -> trainer -> plan (tools/import_graph.py).
        args = [sys.executable, "-c", "import sys, capstan.engine.run.trainer; "
                "from capstan.engine.plan.probe import main; main(*sys.argv[1:])", out]
        if shapes:
            args.append(os.path.join(tmp, "shapes.json"))
            Path(args[-1]).write_text(json.dumps([{"shape": asdict(s), "layout": asdict(lay)} for s, lay in shapes]))
        cmd = build_command(args, ranks)
        env = {k: v for k, v in os.environ.items() if k != "CAPSTAN_RENDEZVOUS_FILE"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0 or not os.path.exists(out):
            raise PlanError(f"the calibration probe under mpirun -np {ranks} failed (exit {done.returncode}): "
                            + (done.stderr.strip().splitlines() or ["no output"])[-1])
        return json.loads(Path(out).read_text())


def _median(fn, reps: int = 7) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu_rates(threads: int) -> dict:
    from capstan.native import kernels

    n = 1 << 22
    kernels.set_num_threads(threads)
    p, g, m, v = torch.zeros(n), torch.full((n,), 1e-3), torch.zeros(n), torch.zeros(n)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    src, dst = torch.ones(4 * n), torch.empty(4 * n)
    step = [0]

    def adam() -> None:
        step[0] += 1
        kernels.adam_update(p, g, m, v, step=step[0], lr=1e-3, weight_decay=0.01)

    def adam_cast() -> None:
        step[0] += 1
        kernels.adam_update_and_cast(p, g, m, v, out16, step=step[0], lr=1e-3, weight_decay=0.01)

    return {"memory_bandwidth": 2 * 4 * 4 * n / _median(lambda: kernels.copy_(dst, src)),
            "adam": {"fp32": n / _median(adam), "mixed": n / _median(adam_cast),
                     "sumsq": n / _median(lambda: kernels.sumsq(g))}}


def _compression_rates() -> dict[str, float]:
    """Seconds per parameter of compression's local work on one rank (what the link's seconds leave out):
    a 1-bit Adam step past its freeze (the momentum update, `comm.onebit_all_reduce`'s packing and
    unpacking in both stages, the step over the frozen variance: zero/compression.py's calls), and one
    int8 collective's quantizing and dequantizing of every element."""
    from capstan.chunkmem.optim.onebit import frozen_variance_step
    from capstan.comm import Group, dequantize_int8, onebit_all_reduce, onebit_residual_sizes, quantize_int8

    n = 1 << 22
    solo = Group("calibrate", (0,), 0)  # one rank: the packing without the exchange, which the links time
    p, g, m, v = torch.zeros(n), torch.randn(n), torch.zeros(n), torch.rand(n)
    worker, server = (torch.zeros(k) for k in onebit_residual_sizes(n, 1))

    def onebit() -> None:
        m.mul_(0.9).add_(g, alpha=0.1)
        onebit_all_reduce(m, worker, server, group=solo)
        frozen_variance_step(p, m, v, step=30, freeze_steps=20, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=0.01)

    def int8() -> None:
        dequantize_int8(*quantize_int8(g))

    return {"onebit": _median(onebit) / n, "int8": _median(int8) / n}


def _per_access() -> float:
    """Seconds of one chunkmem access + release of a resident chunk (what a hook does per parameter)."""
    from capstan.chunkmem import ChunkManager
    from capstan.chunkmem.model.chunk import Chunk, ChunkKind

    manager = ChunkManager(cpu_budget=1 << 30)
    chunk = Chunk(0, ChunkKind.PARAM, torch.float32, 1024)
    manager.add(chunk, torch.zeros(1024))
    n = 2000

    def run() -> None:
        for _ in range(n):
            manager.access(0)
            manager.release(0)

    try:
        return _median(run, 5) / n
    finally:
        manager.close()


def _runtime(threads: int) -> dict[str, float]:
    """overhead.py in a fresh interpreter: first compute, 16-bit kernels, torch's heavy modules (bytes)."""
    env = {k: v for k, v in os.environ.items() if k != "CAPSTAN_RENDEZVOUS_FILE"}
    done = subprocess.run([sys.executable, "-m", "capstan.engine.plan.overhead", str(threads)], capture_output=True,
                          text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise PlanError("the calibration's memory probe failed: " + (done.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


JOBS = ({"d_model": 64, "seq_len": 32, "micro": 2}, {"d_model": 384, "seq_len": 256, "micro": 4})  # tiny, small


def _job(layout: Layout, run_dir: Path, size: dict) -> str:
    """A capstan config of a small reference GPT (`size`) laid out as `layout`, for a few steps."""
    accum = max(layout.accum, 2 * layout.pp) if layout.pp > 1 else layout.accum
    layers = max(2, layout.pp * layout.virtual_stages)
    lines = ["[model]", f"n_layers = {layers}", "n_heads = 4", f"d_model = {size['d_model']}",
             f"seq_len = {size['seq_len']}", "[data]", "max_bytes = 100_000", "[train]", "steps = 4",
             "warmup_steps = 1",
             f"micro_batch_size = {size['micro']}", f"grad_accum_steps = {accum}", "[parallel]", f"dp = {layout.dp}",
             f"tp = {layout.tp}", f"pp = {layout.pp}", f"cp = {layout.cp}", f'cp_mode = "{layout.cp_mode}"',
             f"zero_stage = {layout.zero_stage}",
             f'schedule = "{layout.schedule}"', f"virtual_stages = {layout.virtual_stages}",
             f"sequence_parallel = {str(layout.sequence_parallel).lower()}", "[memory]",
             f'offload = "{layout.offload}"', f"activation_checkpointing = {str(layout.recompute).lower()}",
             f"mlp_tile = {layout.mlp_tile}",
             f'disk_dir = "{run_dir / "chunks"}"', "[precision]", f'dtype = "{layout.precision}"',
             "[log]", f'run_dir = "{run_dir}"', "every = 100"]
    if layout.offload == "disk":  # half the states in RAM (at least what the chunks need at once)
        from .chunks import chunk_lists

        shape = ModelShape(layers=layers, hidden=size["d_model"], heads=4, vocab=256, seq=size["seq_len"])
        lists = chunk_lists(shape, replace(layout, accum=accum, micro=size["micro"], offload="cpu", cpu_budget=None),
                            list(range(layers + 3)))
        budget = max(2 * lists.minimum_budget(), lists.state_bytes() // 2)
        lines.insert(lines.index("[precision]"), f"cpu_budget = {budget}")
    return "\n".join(lines) + "\n"


def _layout_overhead(layout: Layout, rates: Rates, disk_dir: str | os.PathLike) -> tuple[int, float]:
    """What a run laid out as `layout` holds besides the tensors the plan counts: a fixed part (process
    groups and their buffers, the pipeline's, compute libraries, the modules a feature imports) and a part
    that grows with the tensors (the allocator's slack). Two small models are run as the job would be
    (JOBS); each one's peak resident memory of the largest rank less its plan's tensors is the overhead
    at its size: the line through both gives (fixed bytes, slack per tensor byte)."""
    points = [_overhead_at(layout, rates, disk_dir, size) for size in JOBS]
    (t1, o1), (t2, o2) = points
    slack = max(0.0, (o2 - o1) / (t2 - t1)) if t2 > t1 else 0.0
    return max(0, int(o1 - slack * t1)), slack


def _overhead_at(layout: Layout, rates: Rates, disk_dir: str | os.PathLike, size: dict) -> tuple[int, int]:
    """(the plan's tensor bytes, measured peak less them) of one launched run of `_job`."""
    from ..run.mpirun import build_command
    from .spec import save_machine

    with tempfile.TemporaryDirectory(dir=disk_dir) as tmp:
        run, machine, config = Path(tmp) / "run", Path(tmp) / "machine.json", Path(tmp) / "job.toml"
        bare = replace(rates, host_overhead=0, runtime={}, layout_overhead={}, layout_slack={})
        save_machine(replace(local_machine(), host_overhead=0, rates=bare), machine)
        config.write_text(_job(layout, run, size))
        world = layout.dp * layout.tp * layout.pp * layout.cp
        cmd = build_command([sys.executable, "-m", "capstan.engine.cli", "train", "--config", str(config),
                             "--plan", str(machine)], world)
        env = {k: v for k, v in os.environ.items() if k != "CAPSTAN_RENDEZVOUS_FILE"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0 or not (run / "plan.json").exists():
            raise PlanError(f"the calibration's run of a small {runtime_family(layout)} failed (exit "
                            f"{done.returncode}): " + (done.stderr.strip().splitlines() or ["no output"])[-1])
        ram = json.loads((run / "plan.json").read_text())["ram_bytes"]  # (the plan counts the job's data too)
        return int(ram["predicted"]), max(0, int(ram["measured"] - ram["predicted"]))


def _disk(disk_dir: str | os.PathLike, size: int) -> tuple[float, float]:
    from ..machine.disk_bench import bench_disk

    Path(disk_dir).mkdir(parents=True, exist_ok=True)
    rates = bench_disk(disk_dir, size=size, block=DISK_BLOCK, inflight=1, rounds=3)
    return rates["read_gbs"] * 1e9, rates["write_gbs"] * 1e9


def _profile_key(shape: ModelShape, layout: Layout) -> tuple:
    return (shape, layout.tp, layout.micro, layout.precision, layout.sequence_parallel, layout.dropout, layout.cp,
            layout.cp_mode if layout.cp > 1 else "", layout.mlp_tile)


def calibrate(disk_dir: str | os.PathLike = "runs/calibrate", shapes: list[tuple[ModelShape, Layout]] = (),
              log=print, ranks: tuple[int, ...] = (2, 4), disk_bytes: int = DISK_BYTES,  # noqa: ANN001
              bf16_micro: int = 8, bf16_pairs: int = 7) -> Machine:
    """Measure this machine (module docstring); `shapes`: (model, layout) pairs whose layers to profile;
    `ranks`: the launches whose collectives are measured (2 always; every core's for the busy profiles);
    `bf16_micro`, `bf16_pairs`: sequences of the bf16 reference block and timed pairs of it (`--quick`
    times one sequence 3 times: where the CPU has no bf16 arithmetic a bf16 block runs at a few GFLOP/s,
    8 sequences took 90 s of a 2-core machine's calibration, and one sequence timed 7 times 12 s)."""
    cores = len(os.sched_getaffinity(0))
    layouts = list(shapes)
    profiles = {}  # one profile per distinct (shape, tp slice, micro-batch, precision, sp, dropout)
    for shape, layout in shapes:
        profiles.setdefault(_profile_key(shape, layout), (shape, replace(layout, dp=0)))
    shapes = list(profiles.values())
    log(f"calibrating: collectives under mpirun -np {' and '.join(map(str, sorted({2, *ranks, cores} - {1})))} "
        f"({cores} cores)"
        + (f", {len(shapes)} model layout(s) profiled with every core busy" if shapes else ""))
    probes = {n: _launch_probe(n, shapes if n == cores else ()) for n in sorted({2, *ranks, cores} - {1})}
    threads = probes[2]["threads"]
    collective = {n: _fit(p["all_reduce"], 2 * (n - 1) / n) for n, p in probes.items()}
    gather = {n: _fit(p["all_gather"], (n - 1)) for n, p in probes.items()}  # wire: (n-1) x the input
    all_to_all = {n: _fit(p["all_to_all"], (n - 1) / n) for n, p in probes.items() if len(p.get("all_to_all", {})) > 1}
    p2p = _fit(probes[2]["p2p"], 1.0)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        log(f"calibrating: compute, memory and optimizer at {threads} thread(s) per rank")
        alone = block_seconds()
        contention = probes[2].get("block_together", alone) / alone
        ref = ModelShape(layers=1, hidden=512, heads=8, vocab=256, seq=128)
        fp32 = 3 * block_flops(ref, 1, 8) / alone
        bf16 = _bf16_block_rate(ref, threads, bf16_micro, bf16_pairs)
        cpu = _cpu_rates(threads)
        compression = _compression_rates()
        per_access = _per_access()
    finally:
        torch.set_num_threads(saved)
    log("calibrating: what a process holds besides its model (a fresh interpreter)")
    runtime = _runtime(threads)
    log(f"calibrating: disk in {disk_dir} (direct I/O, {disk_bytes >> 20} MiB in {DISK_BLOCK >> 20} MiB requests)")
    read, write = _disk(disk_dir, disk_bytes)
    busy = {k: LayerCost(**v) for p in probes.values() for k, v in p.get("layers", {}).items()}
    rates = Rates(source=f"capstan plan --calibrate on this machine, {time.strftime('%Y-%m-%d %H:%M')}",
                  threads=threads, cores=cores, flops={"fp32": fp32, "bf16": bf16, "fp16": bf16},
                  memory_bandwidth=cpu["memory_bandwidth"], adam=cpu["adam"], disk_read=read, disk_write=write,
                  collective=collective, gather=gather, all_to_all=all_to_all, p2p=p2p, contention=max(1.0, contention),
                  host_overhead=max(p["rss"] for p in probes.values()),
                  runtime={k: int(v) for k, v in runtime.items() if k != "step_overhead_s"},
                  step_overhead=runtime["step_overhead_s"], per_access=per_access, compression=compression,
                  layers=busy)
    for shape, layout in shapes:
        log(f"calibrating: profiling the layers of {shape.layers} x {shape.hidden} (tp {layout.tp}, micro "
            f"{layout.micro}, {layout.precision}) alone")
        layer_costs(shape, layout, rates, measure=True, threads=threads)
    families = {runtime_family(replace(lay, dp=lay.dp or 1)): replace(lay, dp=lay.dp or 1) for _, lay in layouts}
    Path(disk_dir).mkdir(parents=True, exist_ok=True)
    for family, layout in families.items():
        log(f"calibrating: what a run of {family} holds besides its tensors (two small models, launched)")
        rates.layout_overhead[family], rates.layout_slack[family] = _layout_overhead(layout, rates, disk_dir)
    free = os.statvfs(disk_dir)
    base = local_machine()
    return replace(base, name="local (calibrated)", disk=free.f_bavail * free.f_frsize,
                   host_overhead=rates.host_overhead,
                   disk_read=read, disk_write=write, source=rates.source, rates=rates)


def _bf16_block_rate(shape: ModelShape, threads: int, micro: int = 8, pairs: int = 7) -> float:
    from .costs import measure_layers

    cost = measure_layers(shape, Layout(micro=micro, precision="bf16"), threads, least=pairs)["block"]
    return 3 * block_flops(shape, 1, micro) / (cost.forward + cost.backward)
