"""Rank processes forked from a process that has already imported torch.

Why: a fresh interpreter spends about 3.5 s of CPU importing torch on the
2-core CI machine, and the suite starts several hundred ranks (2 to 8 per
multi-rank test), each paying it while its peers pay it too on the same two
cores. A rank forked from a server that imported torch once starts in a few
milliseconds with the same modules. PyTorch's own DataLoader workers are
forked the same way; what makes it safe is that the server runs no torch op
(no OpenMP, BLAS or device state exists before the fork; CUDA in particular is
never initialized there, so a forked rank may use a GPU).

What stays as in a fresh process: each rank gets its own session (killing its
process group kills it), its own output file on stdout and stderr, /dev/null
on stdin, the working directory and the full environment the harness gives
it, and an exit status the harness reads as Popen's (negative: killed by that
signal). What does not: variables read while torch is imported (threads:
OMP_*, MKL_*; PYTHONPATH, LD_PRELOAD, TORCH_*, ...) take effect only at the
server's start, so the harness keeps one server per distinct set of them
(`import_time_env`). numpy's global generator is reseeded in each rank, as
Python's `random` reseeds itself after a fork.

The server reaps its children and writes each exit status to the file named
in the request (the harness, not the server's parent of the rank, polls it).
It exits when the harness's connection closes. CAPSTAN_TEST_FORKSERVER=0
starts every rank as a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import os
import secrets
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

from . import worker

# Prefixes of the variables read while the interpreter starts or torch is imported (see the docstring).
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_", "PYTORCH_",
                        "CUDA_", "NCCL_", "CAPSTAN_STANDIN", "MALLOC_",
                        "GLIBC_TUNABLES")


def import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of `env` a server must have been started with for a rank forked from it to see it."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))


def _start_rank(request: dict) -> None:
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
                pass  # the run's directory is gone: nobody waits for this rank any more


def serve(conn: Connection) -> None:
    """Fork a rank for each request on `conn` (answering its pid) until the connection closes."""
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
                conn.send(f"fork failed: {e}")
                continue
            if pid == 0:
                conn.close()
                _start_rank(request)
            exits[pid] = request["exit"]
            conn.send(pid)
        _reap(exits)


class ForkedRank:
    """A rank forked by a server, seen as `subprocess.Popen` sees its child (pid, poll, wait, returncode)."""

    def __init__(self, pid: int, exit_path: Path, server: subprocess.Popen) -> None:
        self.pid, self.exit_path, self.server = pid, exit_path, server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self.exit_path.read_text())
            except FileNotFoundError:
                if self.server.poll() is not None and not _alive(self.pid):
                    self.returncode = -signal.SIGKILL  # its server died before it could report: assume killed
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="capstan-forkserver-")
        address = os.path.join(self.dir, "socket")
        key = secrets.token_bytes(16)
        with open(os.path.join(self.dir, "server.log"), "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "capstan.comm.testing.forkserver", address],
                                            env=dict(env, CAPSTAN_FORKSERVER_KEY=key.hex()),
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120.0
        while True:  # the server imports torch before it listens
            try:
                self.conn = Client(address, family="AF_UNIX", authkey=key)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    with open(os.path.join(self.dir, "server.log"), errors="replace") as log:
                        why = log.read()[-2000:]
                    self.close()
                    raise RuntimeError(f"the rank fork server did not start:\n{why}") from None
                time.sleep(0.02)

    def fork(self, request: dict) -> int:
        self.conn.send(request)
        pid = self.conn.recv()
        if not isinstance(pid, int):
            raise RuntimeError(str(pid))
        return pid

    def close(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None:
            conn.close()
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
            and os.environ.get("CAPSTAN_TEST_FORKSERVER", "1") != "0")


def start_rank(env: dict[str, str], spec: Path, log: Path, exit_path: Path) -> ForkedRank:
    """Fork a rank running `worker.main(spec)` with `env`, output to `log` (see the module docstring).
    Raises RuntimeError where no server can start or fork; the caller then starts the rank itself."""
    key = import_time_env(env)
    with _lock:
        server = _SERVERS.pop(key, None)
        if server is not None and server.process.poll() is not None:
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
        _SERVERS[key] = server  # most recently used last
        request = {"env": env, "spec": str(spec), "log": str(log), "exit": str(exit_path), "cwd": os.getcwd()}
        try:
            pid = server.fork(request)
        except (OSError, EOFError):
            _SERVERS.pop(key).close()
            raise RuntimeError("the rank fork server is gone") from None
    return ForkedRank(pid, exit_path, server.process)


@atexit.register
def _close_servers() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def main(address: str, authkey: str) -> None:
    import torch  # the reason this process exists

    if torch.cuda.is_initialized():  # a forked rank could not use the GPU: let the harness start fresh ones
        raise SystemExit("CUDA was initialized while torch was imported")

    with Listener(address, family="AF_UNIX", authkey=bytes.fromhex(authkey)) as listener:
        with listener.accept() as conn:
            serve(conn)


if __name__ == "__main__":
    main(sys.argv[1], os.environ.pop("CAPSTAN_FORKSERVER_KEY"))
