"""capstan's CPU collectives through mpi4py, on zero-copy numpy views of the tensors.

Used when `init()` chose the ``mpi`` backend (launched by mpirun, mpi4py
present, no CUDA). MPI has no reduction for 16-bit floats, so bf16/fp16
collectives stay on the gloo group; fp32, fp64 and integers go here.

MPI calls block without a timeout; a watchdog thread turns a collective that
outlives the configured timeout into a CommError message and MPI_Abort (a
clean, named, non-zero exit of the whole job) instead of a silent hang.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from . import state

__all__ = ["supports", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"]

_NUMPY_OK = {torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.int8}


def supports(tensor: torch.Tensor, group: object) -> bool:
    """True when this tensor's collective can run through MPI on this group."""
    return (
        getattr(group, "mpi_comm", None) is not None
        and tensor.device.type == "cpu"
        and tensor.dtype in _NUMPY_OK
    )


def _view(t: torch.Tensor) -> np.ndarray:
    return t.detach().view(-1).numpy()  # shares memory: no copy


def _op(name: str) -> object:
    from mpi4py import MPI

    return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[name]


class _Watchdog:
    """One daemon thread that aborts the job when a blocking MPI call overruns its deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: tuple[str, float] | None = None
        self._thread: threading.Thread | None = None

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="capstan-mpi-watchdog", daemon=True)
            self._thread.start()
        with self._lock:
            self._current = (what, time.monotonic() + state.timeout().total_seconds())
        try:
            yield
        finally:
            with self._lock:
                self._current = None

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                current = self._current
            if current is not None and time.monotonic() > current[1]:
                from mpi4py import MPI

                secs = state.timeout().total_seconds()
                sys.stderr.write(f"CommError: {current[0]} timed out after {secs:.0f} s; aborting the MPI job\n")
                sys.stderr.flush()
                MPI.COMM_WORLD.Abort(1)


_watchdog = _Watchdog()


def all_reduce(tensor: torch.Tensor, op: str, group: object) -> None:
    from mpi4py import MPI

    comm = group.mpi_comm  # type: ignore[attr-defined]
    buf = _view(tensor)
    with _watchdog.guard(f"all_reduce on group {group}"):
        comm.Allreduce(MPI.IN_PLACE, buf, op=_op(op))
    if op == "avg":
        tensor.div_(comm.Get_size())


def all_gather(output: torch.Tensor, tensor: torch.Tensor, counts: list[int], group: object) -> None:
    comm = group.mpi_comm  # type: ignore[attr-defined]
    with _watchdog.guard(f"all_gather on group {group}"):
        if len(set(counts)) == 1:
            comm.Allgather(_view(tensor), _view(output))
        else:
            comm.Allgatherv(_view(tensor), [_view(output), counts])


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, counts: list[int], op: str, group: object) -> None:
    comm = group.mpi_comm  # type: ignore[attr-defined]
    with _watchdog.guard(f"reduce_scatter on group {group}"):
        comm.Reduce_scatter(_view(tensor), _view(output), recvcounts=counts, op=_op(op))
    if op == "avg":
        output.div_(comm.Get_size())


def broadcast(tensor: torch.Tensor, src_index: int, group: object) -> None:
    comm = group.mpi_comm  # type: ignore[attr-defined]
    with _watchdog.guard(f"broadcast on group {group}"):
        comm.Bcast(_view(tensor), root=src_index)


def barrier(group: object) -> None:
    comm = group.mpi_comm  # type: ignore[attr-defined]
    with _watchdog.guard(f"barrier on group {group}"):
        comm.Barrier()
