"""The `capstan train` loop: validated config + opened data -> engine -> steps, metrics, checkpoints, plot.

`run(cfg, sources, data)` is called by the command line after every input
check has passed (cli/commands.py); it starts comm when the launcher says there are
several processes, and returns when the run is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from capstan import comm
from capstan.comm.health import faults

from .. import checkpoint
from ..build import initialize, resolve_groups
from ..config.load import Sources, to_toml
from ..config.schema import Config
from ..data.sources import TokenData, train_batches, val_batches
from ..engine import Engine
from ..machine.ram_budget import with_default_cpu_budget
from ..report.metrics import MetricsSink, memory_summary, plot_losses, plot_memory, progress_line
from . import stop
from .rundir import check_resume, lock_run

__all__ = ["run"]

log = comm.get_logger(__name__)


def run(cfg: Config, sources: Sources, data: TokenData, plan: str | None = None) -> list[dict]:
    """Train as configured; returns rank 0's metric records (empty on other ranks). plan: not None for
    `capstan train --plan [MACHINE_FILE]` (plan/run.py: the prediction, then predicted vs measured)."""
    groups = resolve_groups(cfg, sources)
    faults.limit_file_size()  # CAPSTAN_FILE_SIZE_LIMIT: a full disk for the fault tests (after MPI's own files)
    locks = lock_run(cfg, groups)  # before anything reads or writes the run directory
    try:
        if cfg.checkpoint.resume:
            check_resume(cfg, groups)
        return _run(cfg, data, groups, plan)
    finally:
        for lock in locks:
            lock.release()


def _run(cfg: Config, data: TokenData, groups: comm.Groups, plan: str | None = None) -> list[dict]:
    watch = None
    # a disk tier's RAM budget, where unset, chosen now: the prediction, the engine and config.resolved.toml use it
    cfg = with_default_cpu_budget(cfg, groups)
    if plan is not None:  # before the model exists: the prediction does not depend on the run
        from ..plan.run import RunPlan

        watch = RunPlan(cfg, groups.world.size, groups.world.rank, plan)
        comm.log_rank0(log, "%s", watch.describe())
    engine = initialize(config=cfg, groups=groups)
    rank0 = groups.world.rank == 0
    dp, dp_rank = groups.dp.size, groups.dp.rank
    derived = cfg.derived(groups.world.size)
    run_dir = Path(cfg.log.run_dir)
    t = cfg.train
    start = 0
    ckpt_root = checkpoint.checkpoint_dir(engine, run_dir)
    if cfg.checkpoint.resume:
        start = checkpoint.load_latest(engine, ckpt_root)
        if start:
            comm.log_rank0(log, "resumed from step %d (%s)", start, ckpt_root)
    if not start and cfg.checkpoint.load:
        start = checkpoint.load(engine, cfg.checkpoint.load)
        comm.log_rank0(log, "loaded step %d from %s", start, cfg.checkpoint.load)
    sink = MetricsSink(run_dir, rank0, cfg.log.tensorboard, append=start > 0)
    if rank0:
        (run_dir / "config.resolved.toml").write_text(to_toml(cfg, derived))
    chunks = engine.states.describe()
    comm.log_rank0(log, "%s%s | %d tokens (%d train, %d validation) from %s | %s",
                   _layout(cfg, groups, engine.device), chunks, len(data.tokens), data.n_train, data.n_val, data.source,
                   ", ".join(f"{k} {v}" for k, v in derived.items()))
    batches = train_batches(data, cfg, dp, dp_rank, start_step=start)
    vals = val_batches(data, cfg, dp, dp_rank) if t.eval_every else []
    try:
        with stop.at_step_boundaries():  # SIGTERM: every rank stops after the same step (stop.py)
            _train_steps(cfg, engine, groups, batches, vals, sink, ckpt_root, start, derived,
                         watch.record() if watch is not None else {})
    except BaseException:
        # Closing after a failure must not replace its error with another (a second failed write of
        # a full disk, a peer already gone): the first one is what the rank reports.
        with contextlib.suppress(Exception):
            sink.close()
        with contextlib.suppress(Exception):
            engine.close()
        raise
    # the last step's RAM at every chunk access, and all the chunks' bytes (where the states track them)
    timeline, states = engine.states.ram_timeline() or (None, None)
    summary = watch.finish(sink.records, engine.disk_file_bytes, groups.world, run_dir) if watch is not None else ""
    sink.close()
    engine.close()
    if summary:
        log.info("%s", summary)
    if rank0 and sink.records:
        wrote = [run_dir / "metrics.jsonl", run_dir / "config.resolved.toml"]
        plot_losses(sink.records, run_dir / "loss.svg")
        wrote.append(run_dir / "loss.svg")
        if states is not None:
            plot_memory(sink.records, timeline or [], cfg.memory.cpu_budget, run_dir / "memory.svg")
            wrote.append(run_dir / "memory.svg")
        log.info("wrote %s", ", ".join(map(str, wrote)))
        last_rec = sink.records[-1]
        log.info("done: %d steps, final loss %.4f, %s", last_rec["step"], last_rec["loss"],
                 memory_summary(sink.records, states, cfg.memory.cpu_budget))
    return sink.records


def _train_steps(cfg: Config, engine: Engine, groups: comm.Groups, batches: Iterator, vals: list,
                 sink: MetricsSink, ckpt_root: Path, start: int, derived: dict, planned: dict) -> None:
    """The training loop: a step, its record and progress line, evaluation and checkpoint, and the
    ranks' agreement on a stop signal at its end. planned: the `plan.*` keys put in every record."""
    t = cfg.train
    elapsed: list[float] = []
    for step in range(start, t.steps):
        info = engine.train_batch(batches)
        faults.crash_point("train.step", step=info.step)
        elapsed.append(info.seconds)
        record = {"step": info.step, "loss": info.loss, "lr": info.lr,
                  "tokens_per_s": derived["tokens_per_step"] / max(info.seconds, 1e-9),
                  "grad_norm": info.grad_norm, "loss_scale": info.loss_scale, "skipped": info.skipped,
                  "step_s": info.seconds, **info.mem, **info.comm, **planned}
        last = step + 1 == t.steps
        if t.eval_every and (info.step % t.eval_every == 0 or last):
            record["val_loss"] = engine.eval_batch(vals)
        sink.write(record)
        if info.step == 1 or info.step % cfg.log.every == 0 or last or record.get("val_loss"):
            recent = elapsed[-20:]  # the first step (warm-up trace, allocation) is slower
            eta = (t.steps - info.step) * sum(recent) / len(recent)
            comm.log_rank0(log, "%s", progress_line(record, t.steps, eta))
        if cfg.checkpoint.every and (info.step % cfg.checkpoint.every == 0 or last):
            engine.save(ckpt_root)
        stop.agree_to_stop(groups.world)


def _layout(cfg: Config, groups: comm.Groups, device: torch.device) -> str:
    p, mem = cfg.parallel, cfg.memory
    where = f"offload {mem.offload}" if mem.offload != "none" else f"ZeRO stage {p.zero_stage}"
    on = f", on {device}" if device.type != "cpu" else ""
    cp = f" x cp {groups.cp.size} ({cfg.parallel.cp_mode})" if groups.cp.size > 1 else ""
    return (f"world {groups.world.size} = dp {groups.dp.size} x tp {groups.tp.size} x pp {groups.pp.size}{cp}, "
            f"{where}, {cfg.precision.dtype}{on}")
