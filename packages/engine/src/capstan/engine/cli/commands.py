"""The `capstan` command line: `capstan train`, `capstan info`, `capstan launch` (launch.py),
`capstan checkpoint inspect|export` (checkpoint/tools.py) and `capstan bench-disk` (disk_bench.py).

    capstan train --config examples/tiny.toml [--set train.steps=10 ...] [--debug]
    mpirun -np 2 capstan train --config examples/tiny.toml
    torchrun --standalone --nproc_per_node 2 -m capstan.engine.cli train --config examples/tiny.toml
    capstan launch -np 2 -- capstan train --config examples/tiny.toml

Bad input (config, data, launch environment, a budget the model cannot fit)
is one line on stderr and exit code 2, on every rank, checked before any
process group starts where possible; ``--debug`` shows the traceback instead.
`main(argv)` returns the exit code (tests call it in-process); `entry()`, the
console script and ``python -m``, runs it as a program (see `entry` for why it
skips interpreter teardown).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..run.stop import Stopped, stop_on_signals

__all__ = ["main", "entry", "build_parser", "EXIT_BAD_INPUT"]

EXIT_BAD_INPUT = 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage + error (two lines) and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _cmd_info(args: argparse.Namespace) -> int:
    from .info import collect_info, format_info

    info = collect_info()
    # --json is one line, written at once, so the outputs of several ranks stay parseable.
    text = json.dumps(info, default=str) if args.json else format_info(info)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0


# Errors by their defining module: an error of a module never imported cannot be the one in flight, and
# importing chunkmem or the checkpoint store to ask would import torch (1.4 s before `capstan launch`'s
# one error line).
_BAD_INPUT = (("capstan.engine.config.load", "ConfigError"), ("capstan.engine.data.sources", "DataError"),
              ("capstan.comm.job.launch_env", "LaunchError"), ("capstan.chunkmem.memory.tiers", "BudgetError"),
              ("capstan.chunkmem.model.layout", "LayoutError"), ("capstan.chunkmem.memory.disk", "DiskTierError"),
              ("capstan.engine.checkpoint.store", "CheckpointError"),
              ("capstan.engine.machine.disk_bench", "DiskBenchError"),
              ("capstan.engine.run.rundir", "RunDirError"), ("capstan.engine.plan.spec", "PlanError"))
# Not capstan bugs either, but no bad input: a lost peer, fp16 gradients overflowing at the least loss scale.
_RUN_FAILURES = (("capstan.comm.health.errors", "CommError"), ("capstan.chunkmem.optim.precision", "LossScaleError"))


def _loaded(errors: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    """The error classes of `errors` whose modules are imported."""
    return tuple(getattr(sys.modules[m], name) for m, name in errors if m in sys.modules)


def _cmd_train(args: argparse.Namespace) -> int:
    with stop_on_signals():
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from importlib.util import find_spec

    from ..config.load import ConfigError, check_world

    # The config first: this needs no torch, so the commonest mistakes fail in a fraction of a second.
    cfg, sources = _resolve_train_config(args)
    from capstan import comm

    from ..data.sources import open_data

    launch = comm.detect_launch()
    check_world(cfg, launch.world_size, launch.describe("world_size"), sources)
    if cfg.log.tensorboard and find_spec("tensorboard") is None:
        raise ConfigError("log.tensorboard = true needs the tensorboard package (pip install tensorboard)")
    data = open_data(cfg)
    if cfg.checkpoint.load:  # before any process group: a wrong path fails fast on every rank
        from ..checkpoint.store import CheckpointError, latest, read_manifest

        found = latest(cfg.checkpoint.load)
        if found is None:
            raise CheckpointError(f"checkpoint.load = {cfg.checkpoint.load!r}: no complete checkpoint there")
        read_manifest(found)
    from ..run.trainer import run

    run(cfg, sources, data, plan=args.plan)
    if comm.is_initialized():
        # Leave together and tear the process group down: a rank exiting with the group alive can
        # make gloo abort the slower peer at interpreter exit. (Not on errors: a peer may be gone.)
        comm.barrier()
        comm.shutdown()
    return 0


def _resolve_train_config(args: argparse.Namespace) -> tuple[object, dict[str, str]]:
    """--config (else the defaults), a --deepspeed config's translation over it, then --set."""
    from ..config import resolve
    from ..config.deepspeed import data_parallel_size, from_deepspeed

    if args.config is None and args.deepspeed is None:
        raise _UsageError("give --config FILE (a capstan config) or --deepspeed FILE (a DeepSpeed config), or both")
    if args.deepspeed is None:
        return resolve(args.config, args.set or [])
    dp = data_parallel_size(args.config, args.set or [], _launch_world_size())
    sections, notes = from_deepspeed(args.deepspeed, dp)
    if _launch_rank() == 0:
        said = ", ".join(f"{s}.{k} = {v!r}" for s, body in sections.items() for k, v in body.items())
        print(f"capstan: deepspeed: {args.deepspeed} -> {said or 'nothing'}", file=sys.stderr)
        for note in notes:
            print(f"capstan: deepspeed: {note}", file=sys.stderr)
    return resolve(args.config, args.set or [], layers=[(sections, f"--deepspeed {args.deepspeed}")])


def _launch_world_size() -> int:
    """The world size a launcher announced (1 without one), from its variables alone: asking
    capstan.comm's bootstrap would import torch."""
    for var in ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def _launch_rank() -> int:
    from capstan.comm.job.launch_env import env_rank

    return env_rank() or 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="capstan", description="Train models too big for the hardware at hand.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    info = sub.add_parser("info", help="versions, native library, MPI, CUDA and the detected launch")
    info.add_argument("--json", action="store_true", help="print as JSON")
    info.set_defaults(func=_cmd_info)
    train = sub.add_parser("train", help="train a model as a config file says (docs/engine.md)")
    train.add_argument("--config", help="TOML or JSON file (docs/config.md)")
    train.add_argument("--deepspeed", metavar="DS_CONFIG", help="a DeepSpeed config JSON, translated over --config "
                                                              "(printed, with every key that has no equivalent)")
    train.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                       help="override one value (a TOML literal or a bare string); repeatable")
    train.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    train.add_argument("--plan", nargs="?", const="", default=None, metavar="MACHINE_FILE",
                       help="print capstan plan's prediction before the first step and record predicted vs "
                            "measured (metrics plan.*, plan.json); rates from MACHINE_FILE or this machine's "
                            "`capstan plan --calibrate` file (docs/plan.md)")
    train.set_defaults(func=_cmd_train)
    ckpt = sub.add_parser("checkpoint", help="inspect or export a checkpoint (docs/checkpoints.md)")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True, parser_class=_Parser)
    inspect = ckpt_sub.add_parser("inspect", help="layout, step, sizes; verifies every shard's checksum")
    inspect.add_argument("dir", help="a step_* directory, or a directory of them (the newest)")
    inspect.add_argument("--json", action="store_true", help="print as JSON")
    inspect.add_argument("--no-verify", action="store_true", help="skip the checksum pass")
    inspect.set_defaults(func=_cmd_checkpoint_inspect)
    export = ckpt_sub.add_parser("export", help="one consolidated safetensors file (+ config JSON), streamed")
    export.add_argument("dir", help="a step_* directory, or a directory of them (the newest)")
    export.add_argument("out", help="the .safetensors file to write (with --format hf: a directory)")
    export.add_argument("--format", default="safetensors", choices=("safetensors", "hf"),
                        help="hf: a directory transformers' from_pretrained loads (a transformers model's checkpoint)")
    export.set_defaults(func=_cmd_checkpoint_export)
    bench = sub.add_parser("bench-disk", help="disk and CPU rates for offload, and the step time they allow "
                                              "(docs/chunkmem.md)")
    bench.add_argument("dir", help="where the disk tier would write (a file is written there, then removed)")
    bench.add_argument("--size-mib", type=int, default=1024, help="bytes written then read (default 1024 MiB)")
    bench.add_argument("--block-mib", type=int, default=8, help="bytes per request (default 8 MiB)")
    bench.add_argument("--inflight", type=int, default=8, help="requests in flight (default 8)")
    bench.add_argument("--rounds", type=int, default=1, help="write+read rounds; medians are reported")
    bench.add_argument("--params", default="1B", help="model size for the step-time bounds, e.g. 350M, 7B")
    bench.add_argument("--json", action="store_true", help="print as JSON")
    bench.set_defaults(func=_cmd_bench_disk)
    from .launch import add_parser as add_launch_parser  # `capstan launch` lives in launch.py
    from .plan import add_parser as add_plan_parser  # `capstan plan` lives in plan.py

    add_launch_parser(sub)
    add_plan_parser(sub)
    return parser


def _cmd_checkpoint_inspect(args: argparse.Namespace) -> int:
    from ..checkpoint.tools import format_inspect, inspect

    info = inspect(args.dir, verify=not args.no_verify)
    sys.stdout.write((json.dumps(info) if args.json else format_inspect(info)) + "\n")
    return 0


def _cmd_checkpoint_export(args: argparse.Namespace) -> int:
    from ..checkpoint.tools import export

    out = export(args.dir, args.out, args.format)
    if args.format == "hf":
        print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    else:
        print(f"wrote {out} and {out.parent / (out.stem + '.config.json')}")
    return 0


def _cmd_bench_disk(args: argparse.Namespace) -> int:
    from ..machine.disk_bench import MiB, bench_disk, format_report, offload_floor, parse_count

    params = parse_count(args.params)  # before the measurement: a typo costs nothing
    rates = bench_disk(args.dir, args.size_mib * MiB, args.block_mib * MiB, args.inflight, args.rounds)
    floor = offload_floor(params, rates)
    text = json.dumps({**rates, "floor": floor}) if args.json else format_report(rates, floor)
    sys.stdout.write(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..run.mpirun import (  # status files for `capstan launch` (a no-op otherwise)
        rank_finished,
        rank_started,
    )

    rank_started()
    code = 1
    try:
        code = _main(argv)
        return code
    except KeyboardInterrupt:
        print("capstan: error: interrupted (SIGINT)", file=sys.stderr)
        code = 130
        return code
    finally:
        if code != 0 and "capstan.comm.bootstrap" in sys.modules:  # peers blocked with this rank fail now
            sys.modules["capstan.comm.bootstrap"].announce_failure()  # (not imported: no peers, no torch)
        rank_finished(code)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except _UsageError as exc:
        print(f"capstan: error: {exc} (see capstan --help)", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Stopped as exc:
        print(f"capstan: error: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except Exception as exc:
        if isinstance(exc, _loaded(_RUN_FAILURES)) and not debug:
            # A lost peer, or a run whose fp16 gradients overflow at the minimum loss scale, is not a
            # capstan bug: one line naming it (exit 1), not a traceback per rank.
            print(f"capstan: error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 1
        if debug or not isinstance(exc, _loaded(_BAD_INPUT)):
            raise
        text = " ".join(str(exc).split())  # exactly one line, whatever the message held
        print(f"capstan: error: {text}", file=sys.stderr)
        return EXIT_BAD_INPUT


ERROR_GRACE_S = 1.0


def _multi_rank_launch() -> bool:
    """Whether a launcher started several ranks (asking capstan.comm's bootstrap would import torch:
    seconds of a failing job's exit, and the launcher itself is no rank)."""
    return _launch_world_size() > 1


def _finalize_mpi() -> None:
    """MPI_Finalize, which mpi4py would run at exit: mpirun reports a rank that ends without it as
    an abnormal termination and exits 1 whatever the rank's own status."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except Exception as exc:  # the exit code already says how the run went
        print(f"capstan: warning: MPI_Finalize failed: {exc}", file=sys.stderr)


def entry() -> None:
    """Run `main` as a program and leave with its exit code, without interpreter teardown.

    Why: a gloo worker thread drops its last reference to a finished collective
    (and so to the tensors it held) a moment after the caller's wait returns. When
    that moment falls inside Py_FinalizeEx, releasing a tensor's Python object
    needs the GIL, the finalizing interpreter ends the thread, and libstdc++
    aborts the whole process ("terminate called without an active exception",
    signal 6) after a run that succeeded -- or turns a clean exit 2 into 134.
    Seen in about 1 of 20 four-rank runs on a loaded machine (core dump: gloo
    runLoop -> ~AsyncAllreduceWork -> decref -> take_gil -> pthread_exit), and
    destroy_process_group() does not join gloo's threads. Everything capstan
    writes (metrics, checkpoints, disk-tier files) is closed before `main`
    returns, so only MPI (finalized as mpi4py would at exit), logging and stdio
    are left to close here. (comm's own exit handler now joins gloo's threads,
    `groups.release_at_exit`, which is what keeps a script of one's own safe; this
    exit also keeps any other teardown from changing a finished run's code.)
    """
    import logging
    import time
    import traceback

    try:
        code = main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except (KeyboardInterrupt, Stopped) as exc:
        code = 128 + getattr(exc, "signum", 2)
    except BaseException:
        traceback.print_exc()
        code = 1
    if code != 0 and code < 128 and _multi_rank_launch():
        # Under mpirun the first rank to exit non-zero gets the others killed: let the peers that hit
        # the same bad input print their own line first ("one clear error on every rank").
        time.sleep(ERROR_GRACE_S)
    _finalize_mpi()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe must not change the exit code
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
