"""Rank processes forked from a process that has already imported torch.

Why: a fresh interpreter spends about 3.5 s of CPU importing torch on the
2-core CI machine, and the suite starts several hundred ranks (2 to 8 per
multi-rank test), each paying it while its peers pay it too on the same two
cores. A rank forked from a server that imported torch once starts in a few
milliseconds with the same modules. PyTorch's own DataLoader workers are
forked the same way; what makes it safe is that the server runs no torch op
(no OpenMP, BLAS or device state exists before the fork; CUDA in particular is
never initialized there, so a forked rank may use a GPU).

On only where asked: CAPSTAN_TEST_FORKSERVER=1, which the suite's conftest.py
sets. Benchmarks under tools/ start fresh interpreters, so their peak RSS
(ru_maxrss) keeps its meaning.

What stays as in a fresh process: each rank gets its own session (killing its
process group kills it), its own output file on stdout and stderr, /dev/null
on stdin, the working directory (also first on sys.path, as `python -m` puts
it) and the full environment the harness gives it, and an exit status the
harness reads as Popen's (negative: killed by that signal). What does not:
variables read while the interpreter starts or torch is imported (threads:
OMP_*, MKL_*; PYTHONPATH, LD_PRELOAD, MALLOC_*, TORCH_*, ...) take effect only
at the server's start, so the harness keeps one server per distinct set of
them (`import_time_env`); and every rank of a server shares its string-hash
seed (fresh interpreters each drew one, so a cross-rank disagreement in the
order of a set of strings shows only with CAPSTAN_TEST_FORKSERVER=0). numpy's
global generator is reseeded in each rank, as Python's `random` reseeds itself
after a fork.

The server reaps its children and writes each exit status to the file named
in the request; the harness polls it, and a pidfd of the rank tells it when a
rank ended whose status cannot come (its server died). The server runs in a
session of its own (a terminal's Ctrl-C does not reach it), exits when the
harness's connection closes, and is killed when the harness dies
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from ..health.procmem import pid_alive
from . import worker

# Prefixes of the variables read while the interpreter starts or torch is imported (see the docstring).
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES", "LANG", "LC_", "TMPDIR", "OMP_", "MKL_",
                        "KMP_", "GOMP_", "OPENBLAS_", "NPY_", "TORCH", "PYTORCH_", "CUDA_", "NCCL_", "ASAN_",
                        "UBSAN_", "LSAN_")
UNKNOWN_STATUS = 255  # a rank that ended while its server could not report its status


def import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of `env` a server must have been started with for a rank forked from it to see it."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))


def _start_rank(request: dict, start_dir: str) -> None:
    """In the forked child: become the rank the request describes. Never returns."""
    code = 1
    try:
        os.setsid()
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        if sys.path and sys.path[0] == start_dir:  # `python -m` puts the directory it started in first
            sys.path[0] = request["cwd"]
        os.environ.clear()
        os.environ.update(request["env"])
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed()  # a fresh process draws its own seed
        sys.argv = [worker.__file__, request["spec"]]
        code = worker.main(request["spec"])  # ends the process itself (os._exit)
    except BaseException:  # noqa: BLE001 - whatever happens, the rank must end with a status
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(exits: dict[int, str]) -> None:
    """Write the status of every finished child to its file (atomically: the harness polls for it)."""
    while exits:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exits.pop(pid, None)
        if path is not None:
            tmp = f"{path}.tmp"
            try:
                with open(tmp, "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(tmp, path)
            except OSError:
                pass  # the run's directory is gone or full: the harness sees the rank end by its pidfd


def serve(conn: Connection, listener: Listener) -> None:
    """Fork a rank for each request on `conn` (answering its pid) until the connection closes."""
    start_dir = os.getcwd()
    exits: dict[int, str] = {}
    while True:
        try:
            ready = conn.poll(0.01 if exits else 0.2)
            request = conn.recv() if ready else None
        except (EOFError, OSError):
            return  # the harness is gone; the ranks live on in their own sessions, as Popen's would
        if request is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as e:  # no memory or processes left: the harness starts this rank itself
                conn.send((request["id"], f"fork failed: {e}"))
                continue
            if pid == 0:
                conn.close()
                listener.close()
                _start_rank(request, start_dir)
            exits[pid] = request["exit"]
            conn.send((request["id"], pid))
        _reap(exits)


class ForkedRank:
    """A rank forked by a server, seen as `subprocess.Popen` sees its child (pid, poll, wait, returncode)."""

    def __init__(self, pid: int, exit_path: Path) -> None:
        self.pid, self.exit_path = pid, exit_path
        self.returncode: int | None = None
        self._ended_at: float | None = None
        try:  # tells when the rank ends, whoever reaps it, and is not fooled by a reused pid
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # an old kernel or Python, or the rank already reaped
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            self.returncode = int(self.exit_path.read_text())
        except (FileNotFoundError, ValueError):
            if self._ended():  # its status is due within the server's next reap (10 ms); give it 2 s
                self._ended_at = self._ended_at or time.monotonic()
                if time.monotonic() - self._ended_at > 2.0:
                    self.returncode = UNKNOWN_STATUS
        if self.returncode is not None and self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def _ended(self) -> bool:
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        return not pid_alive(self.pid)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="capstan-fs-")
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.next_id = 0
        try:
            self._start(env)
        except BaseException as e:  # an interrupt too: no server may outlive a start that did not finish
            self.close()
            if isinstance(e, Exception):
                raise RuntimeError(f"the rank fork server did not start: {e!r}\n{self._log()}") from e
            raise

    def _start(self, env: dict[str, str]) -> None:
        address = os.path.join(self.dir, "socket")
        key = secrets.token_bytes(16)
        with open(os.path.join(self.dir, "server.log"), "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "capstan.comm.testing.forkserver", address],
                                            env=dict(env, CAPSTAN_FORKSERVER_KEY=key.hex()),
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + 120.0
        while True:  # the server imports torch before it listens
            try:
                self.conn = Client(address, family="AF_UNIX", authkey=key)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if self.process.poll() is not None:
                    raise RuntimeError(f"it exited with code {self.process.returncode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("it did not listen within 120 s") from None
                time.sleep(0.02)

    def _log(self) -> str:
        try:
            with open(os.path.join(self.dir, "server.log"), errors="replace") as log:
                return log.read()[-2000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def fork(self, request: dict) -> int:
        self.next_id += 1
        request = dict(request, id=self.next_id)
        self.conn.send(request)  # type: ignore[union-attr]
        answer_id, pid = self.conn.recv()  # type: ignore[union-attr]
        if answer_id != self.next_id or not isinstance(pid, int):
            raise RuntimeError(f"the rank fork server answered {pid!r} for request {answer_id}, not {self.next_id}")
        return pid

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_SERVERS: dict[tuple, _Server] = {}  # by import_time_env, least recently used first
_MAX_SERVERS = 3  # each holds an imported torch (~300 MB)
_lock = threading.Lock()
_failed: list[str] = []  # why a server could not start: after one failure every rank starts fresh


def enabled() -> bool:
    return (not _failed and hasattr(os, "fork") and sys.platform == "linux"
            and os.environ.get("CAPSTAN_TEST_FORKSERVER", "0") == "1")


def start_rank(env: dict[str, str], spec: Path, log: Path, exit_path: Path) -> ForkedRank:
    """Fork a rank running `worker.main(spec)` with `env`, output to `log` (see the module docstring).
    Raises RuntimeError where no server can start or fork; the caller then starts the rank itself."""
    key = import_time_env(env)
    with _lock:
        server = _SERVERS.pop(key, None)
        if server is not None and not server.alive():
            server.close()
            server = None
        if server is None:
            while len(_SERVERS) >= _MAX_SERVERS:
                _SERVERS.pop(next(iter(_SERVERS))).close()
            try:
                server = _Server(env)
            except RuntimeError as e:
                _failed.append(str(e))
                warnings.warn(f"{e}\ncapstan.comm.testing starts every rank as a fresh interpreter from now on",
                              stacklevel=3)
                raise
        request = {"env": env, "spec": str(spec), "log": str(log), "exit": str(exit_path), "cwd": os.getcwd()}
        try:
            pid = server.fork(request)
        except BaseException as e:  # its answers may be out of step with its requests now: never ask it again
            server.close()
            if isinstance(e, Exception):
                raise RuntimeError(f"the rank fork server failed: {e!r}") from e
            raise
        _SERVERS[key] = server  # most recently used last
    return ForkedRank(pid, exit_path)


@atexit.register
def _close_servers() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def _die_with_parent() -> None:
    """SIGKILL this process when the one that started it dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # it still exits when the harness's connection closes


def main(address: str, authkey: str) -> None:
    _die_with_parent()
    import torch  # the reason this process exists

    if torch.cuda.is_initialized():  # a forked rank could not use the GPU: let the harness start fresh ones
        raise SystemExit("CUDA was initialized while torch was imported")
    with Listener(address, family="AF_UNIX", authkey=bytes.fromhex(authkey)) as listener:
        with listener.accept() as conn:
            serve(conn, listener)


if __name__ == "__main__":
    main(sys.argv[1], os.environ.pop("CAPSTAN_FORKSERVER_KEY"))
