"""`init()`: from launcher variables to an initialized torch.distributed world.

Rendezvous, by what the launcher gives us:

* test harness: a `FileStore` on the file in ``CAPSTAN_RENDEZVOUS_FILE``;
* torchrun: ``env://`` (torchrun's own store at MASTER_ADDR:MASTER_PORT);
* MASTER_ADDR and MASTER_PORT set (SLURM, or by hand): rank 0 hosts a TCPStore there;
* mpirun with mpi4py and no MASTER_ADDR: rank 0 opens a TCPStore on a free
  port chosen by the kernel and sends its address to the others over MPI, so
  ``mpirun -np 4 python train.py`` needs no extra environment;
* a single process: an in-memory store and a world of one.

Whatever the path, `torch.distributed` ends up initialized with the world
group, so plain PyTorch code keeps working next to capstan.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
from collections.abc import MutableMapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .backends import mpi_backend
from .health.errors import DirLiveness, Liveness, StoreLiveness
from .job import state
from .job.accelerator import device_identity, device_module, is_accelerator, pick_device, transport
from .job.groups import Group, forget_built, release_at_exit, warm_up
from .job.launch_env import LaunchError, LaunchInfo, detect_launch
from .log import get_logger, set_rank_context

__all__ = ["init", "shutdown", "is_initialized", "nccl_environment", "BACKENDS", "CPU_DEFAULT_BACKEND"]

BACKENDS = ("gloo", "nccl", "mpi")
# The faster CPU path measured by tools/bench_comm.py (docs/benchmarks.md): MPI's
# shared-memory collectives beat gloo's TCP loopback at every size. Used when the
# job was launched by mpirun and mpi4py imports; gloo otherwise.
CPU_DEFAULT_BACKEND = "mpi"

log = get_logger(__name__)


def is_initialized() -> bool:
    return state.is_initialized()


DEFAULT_TIMEOUT_S = 300.0
# How long shutdown waits for non-blocking MPI operations nobody waited for (capped by the comm timeout).
# Posted by every rank, they complete in milliseconds; only a dead peer makes them wait this long.
DRAIN_LIMIT_S = 30.0
TIMEOUT_VAR = "CAPSTAN_COMM_TIMEOUT"


def init(backend: str | None = None, timeout: float | timedelta | None = None,
         environ: dict[str, str] | None = None, device: str | torch.device = "auto") -> Group:
    """Discover the launch, rendezvous, and initialize torch.distributed. Returns the world group.

    backend: for CPU tensors, None picks the measured CPU default (mpi under
        mpirun when mpi4py is present, gloo otherwise); "gloo" or "mpi" force
        one ("mpi" reroutes only capstan's own CPU collectives through mpi4py;
        torch.distributed still gets a gloo group). "nccl" needs a GPU per
        local rank. CUDA tensors go through NCCL where every local rank has a
        GPU of its own and backend is not "gloo"/"mpi" on every rank of the job
        (agreed at start-up: `agree_transport`), else staged through host
        memory on every rank (accelerator.py).
    timeout: seconds (or a timedelta) after which a collective or the
        rendezvous fails with an error instead of waiting for a dead peer;
        None: ``CAPSTAN_COMM_TIMEOUT`` seconds if set, else 300.
    device: "auto" (this rank's GPU, ``cuda:<local rank mod GPUs>``, when torch
        sees one, else the CPU), "cpu", "cuda" or a torch.device; made the
        current CUDA device. `comm.device()` returns it.
    """
    if state.is_initialized():
        return state.world()
    backend = backend or os.environ.get("CAPSTAN_COMM_BACKEND") or None
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown comm backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if timeout is None:
        raw = os.environ.get(TIMEOUT_VAR, "")
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise LaunchError(f"environment variable {TIMEOUT_VAR}={raw!r} is not a number of seconds") from None
    raw = os.environ.get(mpi_backend.SEGMENT_VAR, "")
    if raw:
        try:
            mpi_backend.set_segment_mib(float(raw))
        except ValueError:
            raise LaunchError(f"environment variable {mpi_backend.SEGMENT_VAR}={raw!r} is not a number of MiB "
                              ">= 0") from None
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if td.total_seconds() <= 0:
        raise ValueError(f"comm timeout must be positive, got {td.total_seconds()} s")
    info = detect_launch(environ)
    dev = pick_device(device, info.local_rank)
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"comm backend 'nccl' needs a CUDA device; this rank's device is {dev} "
                         f"(torch.cuda.is_available() is {torch.cuda.is_available()})")
    identity = device_identity(dev)  # "" off CUDA: then sharing a GPU is judged by the local count
    how = transport(dev, info.local_world_size, backend, identified=bool(identity))
    if backend == "nccl" and how != "nccl":
        raise ValueError(f"comm backend 'nccl' needs a GPU per local rank: {info.describe('local_world_size')} "
                         f"but {torch.cuda.device_count()} GPU(s) visible")
    if is_accelerator(dev):  # tensors made with the bare device type ("cuda") land on this rank's device
        device_module(dev).set_device(dev)

    mpi_comm = _mpi_world(info, required=backend == "mpi")
    with _InitWatchdog(info, td):
        store, liveness = _rendezvous(info, td, mpi_comm)
        mine, how = how, agree_transport(how, store, info, td, identity)
        if backend == "nccl" and how != "nccl":
            raise ValueError("comm backend 'nccl' needs a GPU per local rank on every rank; a rank cannot use "
                             "NCCL (two ranks run on one GPU, or a rank asked for a CPU backend)")
        if how != mine:
            log.warning("this rank could use NCCL but not every rank can (two ranks run on one GPU, or a rank "
                        "asked for a CPU backend): CUDA tensors go through host memory on every rank")
        if how == "nccl":
            nccl_environment()
        # One process group per device type: CPU tensors keep gloo (or MPI) beside NCCL.
        torch_backend = "cpu:gloo,cuda:nccl" if how == "nccl" else "gloo"
        dist.init_process_group(torch_backend, store=store, rank=info.rank, world_size=info.world_size, timeout=td)
    if backend in (None, "nccl"):
        use_mpi = mpi_comm is not None and CPU_DEFAULT_BACKEND == "mpi" and info.world_size > 1
        backend = "mpi" if use_mpi else "gloo"  # for CPU tensors; CUDA ones go by `how`
    world = Group(
        name="world",
        ranks=tuple(range(info.world_size)),
        rank=info.rank,
        pg=dist.group.WORLD if info.world_size > 1 else None,
        mpi_comm=mpi_comm if backend == "mpi" else None,
    )
    if liveness is not None:
        liveness.start()
    state.set_state(info, world, backend, td, liveness, dev, how)
    set_rank_context(info.rank)
    warm_up(world)  # the world's first NCCL operation is one all ranks join (groups.warm_up)
    # A process group left alive at interpreter exit can abort the process in torch's teardown
    # ("terminate called without an active exception"): tear down and join gloo's workers first.
    atexit.register(_shutdown_at_exit)
    log.debug("initialized: %s, %s, backend %s, device %s (CUDA tensors: %s)", info.describe("rank"),
              info.describe("world_size"), backend, dev, how)
    return world


def agree_transport(mine: str, store: object, info: LaunchInfo, td: timedelta, identity: str = "") -> str:
    """The transport of CUDA tensors every rank uses: `agreed_transport` over every rank's own choice and
    GPU identity (`accelerator.device_identity`).

    Each rank decides alone what it could use (`accelerator.transport`: the backend it was asked for,
    its local GPU count where its GPU has no identity), and those can differ: nodes with different GPU
    counts, a backend set in one rank's environment. Whether two ranks share a GPU only the identities
    of all tell. A rank staging through host memory cannot meet a peer in NCCL, so the choice
    is agreed before the process group exists (it decides the process group's backends): through
    the rendezvous store, the one channel every rank already shares then. Keys carry torchrun's
    restart count, as torch's own do, since its agent store outlives a restart.
    """
    if info.world_size == 1:
        return mine
    prefix = f"capstan/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/transport/"
    store.set(prefix + str(info.rank), f"{mine} {identity}")  # type: ignore[attr-defined]
    keys = [prefix + str(r) for r in range(info.world_size)]
    store.wait(keys, td)  # type: ignore[attr-defined]
    every = [store.get(k).decode().split(" ", 1) for k in keys]  # type: ignore[attr-defined]
    return agreed_transport(mine, [t for t, _ in every], [i for _, i in every])


def agreed_transport(mine: str, every: Sequence[str], identities: Sequence[str] = ()) -> str:
    """NCCL only if every rank can use it and no two ranks run on one GPU (the same identity: NCCL
    refuses a communicator with two ranks on one device), else "host" (staged) for a rank that could:
    if any rank stages, all stage. "host" and "cpu" (no GPU in use) stand as they are."""
    named = [i for i in identities if i]
    if mine == "nccl" and (any(t != "nccl" for t in every) or len(set(named)) < len(named)):
        return "host"
    return mine


# torch's ProcessGroupNCCL reads these when the NCCL process group is created (TORCH_NCCL_* and their
# older NCCL_* names); a value the user set wins.
ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
# 3 (SkipCleanUp, torch's default since 2.2): when a collective outlives the process group's timeout
# (a dead peer never joins it), the watchdog thread raises the timeout, naming the operation, its
# sequence number and how long it ran, and tears the process down. Not 1 (TearDown), which first
# calls ncclCommAbort: that can itself hang (pytorch/pytorch#110723, NVIDIA/nccl#863: recent NCCL
# wants every rank of a communicator to abort it), which is the hang this is meant to end.
ASYNC_ERROR_HANDLING_MODE = "3"


def nccl_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Make a dead peer end an NCCL job within the comm timeout without blocking the host.

    Error handling is asynchronous: the watchdog checks every NCCL operation against the
    process group's timeout (`init`'s `timeout`) and ends the process when one overruns.
    TORCH_NCCL_BLOCKING_WAIT is not set: with it every ``work.wait()`` spins the calling CPU
    thread until the GPU finished the collective, so each synchronous collective (the tensor-
    parallel mappings in every layer, ZeRO-3's gathers inside module hooks) would stall the host
    instead of queueing the kernels that follow. Set it yourself to get a Python exception at the
    timeout instead, at that cost. Called before the NCCL process group exists.
    """
    env = os.environ if environ is None else environ
    if not any(name in env for name in ASYNC_ERROR_HANDLING):
        env[ASYNC_ERROR_HANDLING[0]] = ASYNC_ERROR_HANDLING_MODE


class _InitWatchdog:
    """Ends this rank with one clear error if rendezvous + process-group creation never returns.

    torch's own timeouts do not cover every way to get stuck there: ranks that
    reach a store left by another job on the same MASTER_PORT (rank 0 of this
    job failed to bind it) read that job's addresses and sat in gloo's connect
    for minutes past a 60 s timeout. The main thread is inside C++ then, so no
    exception can reach it: after twice the comm timeout plus a margin (store
    wait, then gloo's connect, each legitimately up to the timeout) the
    watchdog prints the error and exits the process with status 1.
    """

    MARGIN_S = 10.0

    def __init__(self, info: LaunchInfo, td: timedelta) -> None:
        self.info, self.limit = info, 2 * td.total_seconds() + self.MARGIN_S
        self._done = threading.Event()

    def __enter__(self) -> _InitWatchdog:
        if self.info.world_size > 1:
            threading.Thread(target=self._run, name="capstan-init-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _run(self) -> None:
        if self._done.wait(self.limit):
            return
        where = f"{self.info.master_addr}:{self.info.master_port}" if self.info.master_port else "the rendezvous"
        sys.stderr.write(
            f"capstan: error: rank {self.info.rank} of {self.info.world_size} could not join the job within "
            f"{self.limit:.0f} s (rendezvous at {where}; another job on the same port, or a rank that never "
            f"started?)\n"
        )
        sys.stderr.flush()
        os._exit(1)


def announce_failure() -> None:
    """This rank is about to exit on an error of its own: tell the peers (a no-op before `init`).

    Under mpirun a peer blocked in a collective with it then aborts the job within a second or
    two, naming it, instead of waiting out the comm timeout (mpi_backend's watchdog); never
    raises, never hangs.
    """
    liveness = state.liveness()
    if liveness is not None:
        liveness.announce_failure()


def shutdown() -> None:
    """Tear down the process group (safe to call when nothing was initialized).

    Non-blocking MPI operations nobody waited for are completed first (see
    `mpi_backend.drain`): their buffers must not be freed while MPI writes into them.
    """
    if mpi_backend.inflight():
        left = mpi_backend.drain(min(state.timeout_s(), DRAIN_LIMIT_S))
        if left:
            log.warning("shutdown: %d non-blocking MPI operation(s) did not complete within %.0f s; their buffers "
                        "are kept until the process exits", left, min(state.timeout_s(), DRAIN_LIMIT_S))
    forget_built()
    if dist.is_initialized():
        dist.destroy_process_group()
    state.clear()
    set_rank_context(None)


def _shutdown_at_exit() -> None:
    """`shutdown`, then destroy every ProcessGroup still referenced (`groups.release_at_exit`)."""
    shutdown()
    release_at_exit()


def _mpi_world(info: LaunchInfo, required: bool) -> object | None:
    """mpi4py's COMM_WORLD when this job was launched by MPI (None if mpi4py is absent)."""
    if not (info.is_mpi or (required and info.launcher == "slurm")):
        if required and info.world_size > 1:
            raise LaunchError(
                f"comm backend 'mpi' needs an MPI launch (mpirun/mpiexec); this is a {info.launcher} launch"
            )
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        if required:
            raise LaunchError("comm backend 'mpi' needs mpi4py: pip install 'capstan-comm[mpi]'") from None
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.world_size or comm.Get_rank() != info.rank:
        raise LaunchError(
            f"MPI reports rank {comm.Get_rank()} of {comm.Get_size()} but {info.describe('rank')} and "
            f"{info.describe('world_size')}: the launcher and the MPI library disagree"
        )
    return comm


def _tcp_store(addr: str, port: int, info: LaunchInfo, td: timedelta, master: bool) -> dist.TCPStore:
    try:
        return dist.TCPStore(addr, port, info.world_size, master, timeout=td, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        where = f"{addr}:{port}" + (f" ({info.describe('master_port')})" if info.master_port else "")
        if master and "in use" in str(exc).lower():
            raise LaunchError(f"rendezvous port {where} is already in use; choose another MASTER_PORT") from None
        raise LaunchError(f"rendezvous with {where} failed: {exc}") from None


def _rendezvous(info: LaunchInfo, td: timedelta, mpi_comm: object | None) -> tuple[object, Liveness | None]:
    if info.world_size == 1:
        return dist.HashStore(), None
    if info.rendezvous_file:
        store = dist.FileStore(info.rendezvous_file, info.world_size)
        return store, DirLiveness(info.rank, info.rendezvous_file + ".alive")
    addr, port = info.master_addr, info.master_port
    if info.launcher == "torchrun" or (addr and port):
        if not (addr and port):
            raise LaunchError("torchrun-style launch without MASTER_ADDR and MASTER_PORT")
        if info.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = _tcp_store(addr, port, info, td, master=False)
        else:
            store = _tcp_store(addr, port, info, td, master=info.rank == 0)
    elif mpi_comm is not None:
        store, addr, port = _mpi_rendezvous(info, td, mpi_comm)
    elif info.local_world_size < info.world_size:
        raise LaunchError(
            f"multi-node {info.launcher} launch ({info.describe('world_size')}, "
            f"{info.describe('local_world_size')}) but no rendezvous address: set MASTER_ADDR and "
            "MASTER_PORT, or install mpi4py so rank 0 can share its address over MPI"
        )
    else:
        raise LaunchError(
            f"{info.launcher} launch of {info.world_size} ranks without MASTER_ADDR/MASTER_PORT and without "
            "mpi4py: set both variables or pip install 'capstan-comm[mpi]'"
        )
    serves = info.rank == 0 and not (
        info.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    )
    liveness = StoreLiveness(info.rank,
                             lambda: dist.TCPStore(addr, port, None, False, timeout=td, wait_for_workers=False),
                             world_size=info.world_size, serves_store=serves)
    return store, liveness


def _mpi_rendezvous(info: LaunchInfo, td: timedelta, comm: object) -> tuple[object, str, int]:
    """Rank 0 opens a store on a kernel-chosen port and broadcasts where it is."""
    hosts = comm.allgather(socket.gethostname())  # type: ignore[attr-defined]
    payload: tuple[str, int, str] | None = None
    store = None
    if info.rank == 0:
        single_host = len(set(hosts)) == 1
        addr = "127.0.0.1" if single_host else _routable_address()
        try:
            store = dist.TCPStore(addr, 0, info.world_size, True, timeout=td, wait_for_workers=False)
            payload = (addr, store.port, "")
        except (RuntimeError, OSError) as exc:
            payload = ("", 0, f"rank 0 could not open a rendezvous store: {exc}")
    addr, port, err = comm.bcast(payload, root=0)  # type: ignore[attr-defined]
    if err:
        raise LaunchError(err)
    if store is None:
        store = _tcp_store(addr, port, info, td, master=False)
    return store, addr, port


def _routable_address() -> str:
    """This host's address as other hosts resolve it; set MASTER_ADDR where that is wrong."""
    return socket.gethostbyname(socket.getfqdn())
