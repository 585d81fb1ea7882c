"""The process-wide communication state that `init()` sets up (one per process).

Only bootstrap writes it; collectives read the backend, timeout and liveness
from it. Groups themselves are passed explicitly (see `groups.py`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..health.errors import Liveness
    from .groups import Group
    from .launch_env import LaunchInfo

_launch: LaunchInfo | None = None
_world: Group | None = None
_backend: str = "none"
_timeout: timedelta = timedelta(seconds=300)
_liveness: Liveness | None = None
_debug: bool = False
_timeout_s: float = 300.0
_device: torch.device = torch.device("cpu")
_transport: str = "cpu"  # how CUDA tensors travel: "cpu" (none in use), "nccl" or "host" (accelerator.py)


def set_state(launch: LaunchInfo, world: Group, backend: str, timeout: timedelta, liveness: Liveness | None,
              device: torch.device | None = None, transport: str = "cpu") -> None:
    global _launch, _world, _backend, _timeout, _liveness, _debug, _timeout_s, _device, _transport
    from ..log import debug_comm

    _launch, _world, _backend, _timeout, _liveness = launch, world, backend, timeout, liveness
    _device, _transport = device or torch.device("cpu"), transport
    _debug = debug_comm()
    _timeout_s = timeout.total_seconds()


def clear() -> None:
    global _launch, _world, _backend, _liveness, _device, _transport
    if _liveness is not None:
        _liveness.stop()
    _launch, _world, _backend, _liveness = None, None, "none", None
    _device, _transport = torch.device("cpu"), "cpu"


def is_initialized() -> bool:
    return _world is not None


def _require() -> None:
    if _world is None:
        raise RuntimeError("capstan.comm is not initialized: call capstan.comm.init() first")


def launch() -> LaunchInfo:
    _require()
    return _launch  # type: ignore[return-value]


def world() -> Group:
    _require()
    return _world  # type: ignore[return-value]


def backend() -> str:
    """'gloo', 'nccl' or 'mpi' (capstan's CPU collectives through mpi4py); 'none' before init."""
    return _backend


def device() -> torch.device:
    """The device this rank computes on (`init(device=...)`; the CPU before init)."""
    return _device


def transport() -> str:
    """How collectives reach CUDA tensors: "nccl", "host" (staged through RAM) or "cpu" (no GPU in use)."""
    return _transport


def timeout() -> timedelta:
    return _timeout


def liveness() -> Liveness | None:
    return _liveness


def debug() -> bool:
    """CAPSTAN_DEBUG_COMM as read at init (read once: it is checked on every collective)."""
    return _debug


def timeout_s() -> float:
    """The comm timeout in seconds (cached: read on every MPI call)."""
    return _timeout_s
