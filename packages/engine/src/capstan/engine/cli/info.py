"""`capstan info`: what this installation has and what the launcher told this process."""

from __future__ import annotations

import importlib.metadata as md
import platform
from collections.abc import Callable

__all__ = ["collect_info", "format_info"]


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _mpi_library() -> str:
    try:
        from mpi4py import MPI
    except ImportError:
        return "mpi4py not installed"
    return MPI.Get_library_version().splitlines()[0].strip()


def _guarded(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except Exception as exc:  # info must print even from a broken install
        return f"error: {exc}"


def collect_info() -> dict[str, object]:
    """Everything `capstan info` prints, as a dict (also used by tests and bug reports)."""
    import torch

    from capstan import comm, native
    from capstan.comm.job.launch_env import find_mpirun

    launch = _guarded(comm.detect_launch)
    info: dict[str, object] = {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": torch.__version__,
        "capstan": {name: _version(f"capstan-{name}") for name in
                    ("comm", "native", "chunkmem", "tensorpar", "pipeline", "engine")},
        "mpi4py": _version("mpi4py"),
        "mpi library": _guarded(_mpi_library),
        "mpirun": find_mpirun() or "not found",
        "native": _guarded(native.status),
        "cuda available": torch.cuda.is_available(),
        "cuda devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda": _guarded(comm.cuda_report),
        "torch threads": torch.get_num_threads(),
        "comm default backend": f"{comm.CPU_DEFAULT_BACKEND} under mpirun with mpi4py, else gloo (CPU tensors)"
            + ("; nccl for CUDA tensors with a GPU per local rank, else staged through host memory"
               if torch.cuda.is_available() else ""),
    }
    if isinstance(launch, comm.LaunchInfo):
        info["launcher"] = launch.launcher
        info["world size"] = launch.describe("world_size")
        info["rank"] = launch.describe("rank")
        info["local world size"] = launch.describe("local_world_size")
    else:
        info["launcher"] = launch
    return info


def format_info(info: dict[str, object]) -> str:
    lines = []
    for key, value in info.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {v}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)
