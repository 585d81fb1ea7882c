"""capstan's CPU collectives through mpi4py, on zero-copy numpy views of the tensors.

Used when `init()` chose the ``mpi`` backend (launched by mpirun, mpi4py
present, no CUDA). MPI has no reduction for 16-bit floats, so bf16/fp16
collectives stay on the gloo group; fp32, fp64 and integers go here.

MPI calls block without a timeout; a watchdog thread turns a collective that
outlives the configured timeout into a CommError message and MPI_Abort (a
clean, named, non-zero exit of the whole job) instead of a silent hang.

Every non-blocking request is also entered in `_inflight` with the tensors
it reads and writes until it is waited for. MPI writes into those by address
until the request completes; a request nobody waited for (the ZeRO parameter
all-gathers started after the last step of a run, say) would otherwise let
the interpreter's teardown free them while MPI still delivers into them,
which corrupted the heap and crashed MPI_Finalize. `drain()`, called by
`comm.shutdown()`, completes them first.

Large blocking all-reduces and all-gathers go in segments (`SEGMENT_BYTES`):
Open MPI's choice of algorithm for one call of 32 MiB or more took 2.2-2.6x
as long as the same bytes in 8 MiB calls (2 ranks, shared memory; all-gather
1.5x at 33.5 MiB of output); docs/comm.md has the measurements.
"""

from __future__ import annotations

import sys
import threading
import time
from time import monotonic as _monotonic

import torch

from ..job import state

__all__ = ["supports", "iall_reduce", "iall_gather", "ireduce_scatter", "wait", "all_reduce", "all_gather",
           "reduce_scatter", "reduce", "broadcast", "barrier", "p2p_ok", "post_p2p", "P2PRequests", "drain", "inflight"]

_TYPES: dict[torch.dtype, object] = {}
_OPS: dict[str, object] = {}
_IN_PLACE: list[object] = []
_fromaddress: list = []
_BYTE: list = []
P2P_TAG = 7  # one tag for every capstan point-to-point message: MPI keeps each (source, tag, comm) in order
# id(request) -> (MPI requests, the tensors they use), from start until waited for (see the module docstring).
_inflight: dict[int, tuple[list[object], tuple[torch.Tensor, ...]]] = {}
_kept_forever: list[object] = []  # requests that never completed by shutdown (drain), with their tensors


SEGMENT_VAR = "CAPSTAN_MPI_SEGMENT_MIB"
# Largest message of one blocking all-reduce call (an all-gather's output per call: twice it).
SEGMENT_BYTES = 8 << 20


def set_segment_mib(mib: float) -> None:
    """Set `SEGMENT_BYTES` (`init()` does, from CAPSTAN_MPI_SEGMENT_MIB); 0 sends everything in one
    call. Every rank must use the same value: the ranks call MPI once per segment."""
    global SEGMENT_BYTES
    if not mib >= 0:
        raise ValueError(f"MPI segment size must be >= 0 MiB, got {mib}")
    SEGMENT_BYTES = int(mib * 2**20) or (1 << 62)


def _track(request: object, *tensors: torch.Tensor) -> object:
    _inflight[id(request)] = ([request], tensors)
    return request


def inflight() -> int:
    """How many non-blocking MPI operations were started and not yet waited for."""
    return len(_inflight)


def drain(limit_s: float) -> int:
    """Complete every request nobody waited for, polling up to `limit_s` seconds; return how many were left.

    Called at shutdown, when all ranks have posted what they will post: the
    matching operations complete in milliseconds. A request still open after
    `limit_s` (a peer died) is never freed: its tensors are kept for the life
    of the process, so MPI_Finalize cannot write into memory that was reused.
    """
    if not _inflight:
        return 0
    from mpi4py import MPI

    deadline = _monotonic() + limit_s
    while True:
        for key, (requests, _) in list(_inflight.items()):
            if MPI.Request.Testall(requests):
                del _inflight[key]
        if not _inflight or _monotonic() > deadline:
            break
        time.sleep(0.001)
    left = len(_inflight)
    if left:
        import ctypes

        _kept_forever.extend(_inflight.values())
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_kept_forever))  # survives the module's teardown too
        _inflight.clear()
    return left


def _load() -> None:
    from mpi4py import MPI

    _TYPES.update({
        torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int64: MPI.INT64_T,
        torch.int32: MPI.INT32_T, torch.uint8: MPI.UINT8_T, torch.int8: MPI.INT8_T,
    })
    _OPS.update({"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN})
    _IN_PLACE.append(MPI.IN_PLACE)
    _fromaddress.append(MPI.buffer.fromaddress)
    _BYTE.append(MPI.BYTE)


def fast_ok(tensor: torch.Tensor) -> bool:
    """A CPU tensor of a dtype MPI reduces natively (the group is checked by the caller)."""
    if not _TYPES:
        _load()
    return tensor.dtype in _TYPES and tensor.is_cpu


def supports(tensor: torch.Tensor, group: object) -> bool:
    """True when this tensor's collective can run through MPI on this group."""
    if getattr(group, "mpi_comm", None) is None or not tensor.is_cpu:
        return False
    if not _TYPES:
        _load()
    return tensor.dtype in _TYPES


def _view(t: torch.Tensor) -> list[object]:
    """An MPI buffer over the tensor's own memory (zero copy; cheaper than a numpy view)."""
    return [_fromaddress[0](t.data_ptr(), t.numel() * t.element_size()), _TYPES[t.dtype]]


def _counts_view(t: torch.Tensor, counts: list[int]) -> list[object]:
    buf, mpi_type = _view(t)
    return [buf, counts, mpi_type]


def _op(name: str) -> object:
    return _OPS[name]


WATCH_S = 0.5  # the watchdog's period
GONE_AFTER_S = 1.0  # a call blocked this long starts looking for peers that announced their failure


class _Watchdog:
    """One daemon thread that aborts the job when a blocking MPI call overruns its deadline.

    Callers bracket each MPI call with `arm(op, group)` / `disarm()`. The armed
    state is one attribute replaced whole (atomic under the GIL), so the hot
    path takes no lock and builds no strings: the message is formatted only on
    a timeout.
    """

    def __init__(self) -> None:
        self.current: tuple[str, object, float] | None = None
        self._thread: threading.Thread | None = None

    def arm(self, op: str, group: object) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="capstan-mpi-watchdog", daemon=True)
            self._thread.start()
        self.current = (op, group, _monotonic() + state.timeout_s())

    def disarm(self) -> None:
        self.current = None

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_S)
            current = self.current
            if current is None:
                continue
            op, group, deadline = current
            now = time.monotonic()
            if now > deadline:
                self._abort(f"{op} on group {group} timed out after {state.timeout_s():.0f} s")
            elif now > deadline - state.timeout_s() + GONE_AFTER_S:
                lost = _gone_peers(group)
                if lost and self.current is current:  # (still the same call: it did not complete meanwhile)
                    self._abort(f"{op} on group {group} failed: rank(s) {lost} exited on an error of their own "
                                f"(lost rank(s) {lost})")

    @staticmethod
    def _abort(text: str) -> None:
        from mpi4py import MPI

        sys.stderr.write(f"CommError: {text}; aborting the MPI job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def _gone_peers(group: object) -> list[int]:
    """The members of `group` that announced an exit on an error of their own (else []).

    A blocking MPI call cannot tell that a peer left: one that exits cleanly
    (an error of its own, then MPI_Finalize at exit) leaves the job running
    and stays alive in MPI_Finalize's fence, so its peers blocked until the
    timeout. It announces the failure first (`comm.announce_failure`); the
    heartbeat thread's poll learns it with the verdicts (one store counter per
    beat), and the watchdog reads that set, with no store traffic of its own.
    """
    liveness = state.liveness()
    if liveness is None or not liveness.failed:
        return []
    return sorted(r for r in group.ranks if r in liveness.failed)  # type: ignore[attr-defined]


_watchdog = _Watchdog()


def all_reduce(tensor: torch.Tensor, op: str, group: object) -> None:
    # Written out flat (no helper calls): this is the hottest path for small messages.
    comm = group.mpi_comm  # type: ignore[attr-defined]
    buf = [_fromaddress[0](tensor.data_ptr(), tensor.nbytes), _TYPES[tensor.dtype]]
    wd = _watchdog
    if wd._thread is None:
        wd.arm("all_reduce", group)
    else:
        wd.current = ("all_reduce", group, _monotonic() + state._timeout_s)
    try:
        if tensor.nbytes <= SEGMENT_BYTES:
            comm.Allreduce(_IN_PLACE[0], buf, op=_OPS[op])
        else:
            _all_reduce_segments(comm, tensor, _OPS[op])
    finally:
        wd.current = None
    if op == "avg":
        tensor.div_(comm.Get_size())


def _all_reduce_segments(comm: object, tensor: torch.Tensor, mpi_op: object) -> None:
    """One in-place all-reduce per `SEGMENT_BYTES` of a contiguous tensor (see the module docstring)."""
    flat, mpi_type = tensor.view(-1), _TYPES[tensor.dtype]
    step = max(1, SEGMENT_BYTES // tensor.element_size())
    for start in range(0, flat.numel(), step):
        piece = flat[start:start + step]
        comm.Allreduce(_IN_PLACE[0], [_fromaddress[0](piece.data_ptr(), piece.nbytes), mpi_type], op=mpi_op)  # type: ignore[attr-defined]


def iall_reduce(tensor: torch.Tensor, op: str, group: object) -> object:
    """Start a non-blocking in-place all-reduce (MPI_Iallreduce); `wait` it. The ``avg`` division is the caller's.

    Open MPI progresses non-blocking collectives mostly inside MPI calls, so
    without other MPI traffic much of the transfer may happen in `wait`.
    """
    return _track(group.mpi_comm.Iallreduce(_IN_PLACE[0], _view(tensor), op=_op(op)), tensor)  # type: ignore[attr-defined]


def iall_gather(output: torch.Tensor, tensor: torch.Tensor, group: object) -> object:
    """Start a non-blocking even all-gather (MPI_Iallgather); `wait` it."""
    return _track(group.mpi_comm.Iallgather(_view(tensor), _view(output)), output, tensor)  # type: ignore[attr-defined]


def ireduce_scatter(output: torch.Tensor, tensor: torch.Tensor, counts: list[int] | None, op: str,
                    group: object) -> object:
    """Start a non-blocking reduce-scatter (counts None: even split); `wait` it. ``avg`` is the caller's."""
    comm = group.mpi_comm  # type: ignore[attr-defined]
    if counts is None:
        return _track(comm.Ireduce_scatter_block(_view(tensor), _view(output), op=_op(op)), output, tensor)
    return _track(comm.Ireduce_scatter(_view(tensor), _view(output), recvcounts=counts, op=_op(op)), output, tensor)


def wait(request: object, op: str, group: object) -> None:
    """Wait for a non-blocking collective under the watchdog (an overrun aborts the job with its name)."""
    _watchdog.arm(op, group)
    try:
        request.Wait()  # type: ignore[attr-defined]
    finally:
        _watchdog.disarm()
    _inflight.pop(id(request), None)


def all_gather(output: torch.Tensor, tensor: torch.Tensor, counts: list[int] | None, group: object) -> None:
    """counts None: every rank contributes tensor.numel() elements."""
    comm = group.mpi_comm  # type: ignore[attr-defined]
    _watchdog.arm("all_gather", group)
    try:
        if counts is None and output.nbytes > 2 * SEGMENT_BYTES:
            _all_gather_segments(comm, output, tensor)
        elif counts is None:
            comm.Allgather(_view(tensor), _view(output))
        else:
            comm.Allgatherv(_view(tensor), _counts_view(output, counts))
    finally:
        _watchdog.disarm()


def _all_gather_segments(comm: object, output: torch.Tensor, tensor: torch.Tensor) -> None:
    """An even all-gather in calls of at most 2 x `SEGMENT_BYTES` of output: each call gathers the
    same slice of every rank's part straight to its place in `output` (Allgatherv displacements)."""
    size, n = comm.Get_size(), tensor.numel()  # type: ignore[attr-defined]
    out_buf, mpi_type = _view(output)
    step = max(1, 2 * SEGMENT_BYTES // (size * tensor.element_size()))
    flat = tensor.view(-1)
    for start in range(0, n, step):
        count = min(step, n - start)
        piece = flat[start:start + count]
        comm.Allgatherv([_fromaddress[0](piece.data_ptr(), piece.nbytes), mpi_type],  # type: ignore[attr-defined]
                        [out_buf, [count] * size, [r * n + start for r in range(size)], mpi_type])


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, counts: list[int] | None, op: str,
                   group: object) -> None:
    """counts None: the input divides evenly over the group."""
    comm = group.mpi_comm  # type: ignore[attr-defined]
    _watchdog.arm("reduce_scatter", group)
    try:
        if counts is None:
            comm.Reduce_scatter_block(_view(tensor), _view(output), op=_op(op))
        else:
            comm.Reduce_scatter(_view(tensor), _view(output), recvcounts=counts, op=_op(op))
    finally:
        _watchdog.disarm()
    if op == "avg":
        output.div_(comm.Get_size())


def all_to_all(output: torch.Tensor, tensor: torch.Tensor, group: object) -> None:
    """Equal parts: part i of `tensor` to rank i (alltoall.py)."""
    comm = group.mpi_comm  # type: ignore[attr-defined]
    _watchdog.arm("all_to_all", group)
    try:
        comm.Alltoall(_view(tensor), _view(output))
    finally:
        _watchdog.disarm()


def reduce(tensor: torch.Tensor, op: str, dst_index: int, group: object) -> None:
    comm = group.mpi_comm  # type: ignore[attr-defined]
    buf = _view(tensor)
    _watchdog.arm("reduce", group)
    try:
        if comm.Get_rank() == dst_index:
            comm.Reduce(_IN_PLACE[0], buf, op=_op(op), root=dst_index)
        else:
            comm.Reduce(buf, None, op=_op(op), root=dst_index)
    finally:
        _watchdog.disarm()


def broadcast(tensor: torch.Tensor, src_index: int, group: object) -> None:
    comm = group.mpi_comm  # type: ignore[attr-defined]
    _watchdog.arm("broadcast", group)
    try:
        comm.Bcast(_view(tensor), root=src_index)
    finally:
        _watchdog.disarm()


def barrier(group: object) -> None:
    comm = group.mpi_comm  # type: ignore[attr-defined]
    _watchdog.arm("barrier", group)
    try:
        comm.Barrier()
    finally:
        _watchdog.disarm()


def p2p_ok(group: object) -> bool:
    """True when point-to-point on this group can go through MPI: it has a communicator whose
    rank order is the group's (any dtype travels, as bytes: no reduction is involved)."""
    comm = getattr(group, "mpi_comm", None)
    if comm is None:
        return False
    if not _TYPES:
        _load()
    return comm.Get_rank() == group.rank  # type: ignore[attr-defined]


class P2PRequests:
    """MPI requests of one exchange, holding its tensors: MPI reads and writes them by address
    until the requests complete, so they must outlive the caller's references."""

    def __init__(self, requests: list[object], tensors: list[torch.Tensor]) -> None:
        self.requests, self.tensors = requests, tensors
        _inflight[id(self)] = (requests, tuple(tensors))

    def wait(self, op: str, group: object) -> None:
        from mpi4py import MPI

        _watchdog.arm(op, group)
        try:
            MPI.Request.Waitall(self.requests)
        finally:
            _watchdog.disarm()
        self.tensors = []
        _inflight.pop(id(self), None)

    def is_completed(self) -> bool:
        from mpi4py import MPI

        done = bool(MPI.Request.Testall(self.requests))
        if done:
            _inflight.pop(id(self), None)
        return done


def post_p2p(ops: list[tuple[str, torch.Tensor, int]], group: object) -> P2PRequests:
    """Start MPI_Isend / MPI_Irecv for each (kind, CPU contiguous tensor, peer index in the group)."""
    comm = group.mpi_comm  # type: ignore[attr-defined]
    reqs, keep = [], []
    for kind, t, peer in ops:
        buf = [_fromaddress[0](t.data_ptr(), t.nbytes), _BYTE[0]]
        if kind == "send":
            reqs.append(comm.Isend(buf, dest=peer, tag=P2P_TAG))
        else:
            reqs.append(comm.Irecv(buf, source=peer, tag=P2P_TAG))
        keep.append(t)
    return P2PRequests(reqs, keep)
