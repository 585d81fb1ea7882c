"""Which device a rank computes on, and how collectives reach tensors that live there.

`pick_device(kind, local_rank)`: "cpu"; "cuda" (``cuda:<local rank mod GPUs>``,
an error naming why when torch sees no GPU); "auto" (CUDA when torch sees a
GPU, else the CPU). Ranks of one node get GPUs round-robin, so several ranks
share a GPU when there are more local ranks than GPUs.

`transport(device, local_world_size, backend)` decides how CUDA tensors are
communicated:

* "nccl" when every local rank has a GPU of its own and no CPU-only backend
  was asked for: torch.distributed gets one process group per device type
  (``cpu:gloo,cuda:nccl``), so CPU tensors (losses, flags, checkpoint
  agreement) keep going through gloo (or MPI) while CUDA tensors go through
  NCCL;
* "host" otherwise: NCCL refuses two ranks on one GPU ("Duplicate GPU
  detected"), which is exactly a one-GPU test machine running a 2-rank layout.
  Every collective and point-to-point transfer of a CUDA tensor is then staged
  through host memory (a copy to the CPU, the CPU collective, a copy back):
  slower, but every multi-rank layout runs, and computes the same values, on
  one GPU.

A CPU device needs neither ("cpu").

Device code elsewhere is written once against torch's device-generic API
(`torch.Stream`, `torch.Event`, the device module's memory statistics) through
the helpers below (`is_accelerator`, `indexed`, `device_module`,
`current_stream`), so the same lines run on CUDA and on the CPU suite's
stand-in accelerator (`capstan.native.standin`, device type "standin", which
is not the CPU: a tensor left on the CPU fails there as on a GPU). "standin" is
accepted as a device kind where that stand-in is loaded; "auto" never picks it.
"""

from __future__ import annotations

import socket

import torch

__all__ = ["pick_device", "transport", "DEVICE_KINDS", "DeviceError", "cuda_report", "is_accelerator", "indexed",
           "device_module", "current_stream", "STANDIN"]

STANDIN = "standin"  # the CPU suite's stand-in accelerator (capstan.native.standin)
DEVICE_KINDS = ("auto", "cpu", "cuda", STANDIN)


def is_accelerator(device: torch.device | str | None) -> bool:
    """Whether tensors on `device` live apart from the CPU's (a GPU, or the stand-in)."""
    return device is not None and torch.device(device).type not in ("cpu", "meta")


def indexed(device: torch.device | str) -> torch.device:
    """`device` with its index: ``torch.device("cuda") != torch.device("cuda:0")``, while every tensor
    reports the indexed form, so a device kept for comparisons must carry the index."""
    dev = torch.device(device)
    if dev.index is not None or not is_accelerator(dev):
        return dev
    return torch.device(dev.type, device_module(dev).current_device())


def device_module(device: torch.device | str):
    """``torch.cuda`` for CUDA, ``torch.standin`` for the stand-in: memory statistics, RNG, streams."""
    return torch.get_device_module(torch.device(device).type)


def current_stream(device: torch.device | str) -> torch.Stream:
    """The stream kernels on `device` are issued to now."""
    dev = indexed(device)
    return device_module(dev).current_stream(dev)


def _standin_loaded() -> bool:
    return torch._C._get_privateuse1_backend_name() == STANDIN


class DeviceError(ValueError):
    """The device asked for is not there (e.g. "cuda" without a GPU torch can use)."""


def pick_device(kind: str | torch.device = "auto", local_rank: int = 0) -> torch.device:
    """The torch.device this rank computes on (see the module docstring)."""
    if isinstance(kind, torch.device):
        return kind
    if kind not in DEVICE_KINDS:
        raise DeviceError(f"device {kind!r} is not one of {', '.join(map(repr, DEVICE_KINDS))}")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == STANDIN:
        if not _standin_loaded():
            raise DeviceError(f"device \"{STANDIN}\" (the CPU suite's stand-in accelerator) asked for, but "
                              "capstan.native.standin is not loaded in this process")
        return torch.device(STANDIN, local_rank % device_module(STANDIN).device_count())
    if not torch.cuda.is_available():
        if kind == "auto":
            return torch.device("cpu")
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "torch.cuda.is_available() is False (no GPU visible: driver, CUDA_VISIBLE_DEVICES?)")
        raise DeviceError(f"device \"cuda\" asked for, but {why}; use \"auto\" or \"cpu\"")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def transport(device: torch.device, local_world_size: int, backend: str | None = None,
              identified: bool = False) -> str:
    """How device tensors are communicated: "cpu" (no accelerator in use), "nccl" or "host" (staged).
    The stand-in has no collective library of its own: its tensors are always staged through RAM.

    Ranks sharing a GPU cannot meet in NCCL. With `identified` (this rank's GPU has a `device_identity`)
    whether they share is left to the ranks' agreement on identities (bootstrap.agreed_transport): a
    count would be wrong where each rank sees only its own GPU (SLURM's --gpus-per-task=1, a
    CUDA_VISIBLE_DEVICES per rank), since 8 local ranks then see 1 GPU each and would all stage through
    host memory for nothing. Without one, more local ranks than visible GPUs means sharing."""
    if not is_accelerator(device):
        return "cpu"
    if device.type != "cuda":
        return "host"
    if backend in ("gloo", "mpi"):
        return "host"
    if not identified and local_world_size > torch.cuda.device_count():
        return "host"  # ranks share a GPU: NCCL cannot run there
    return "nccl"


def device_identity(device: torch.device) -> str:
    """Which physical GPU `device` is, as one string in every process that sees it: its host and UUID
    (CUDA_VISIBLE_DEVICES renumbers devices, never their UUIDs); "" for other devices or where torch
    reports no UUID."""
    if device.type != "cuda":
        return ""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"{socket.gethostname()}/{uuid}" if uuid else ""


def cuda_report() -> dict[str, object]:
    """What `capstan info` says about the GPUs: count, names, memory, free memory, driver and CUDA."""
    if not torch.cuda.is_available():
        return {"available": False, "torch cuda": torch.version.cuda or "none (CPU build)"}
    report: dict[str, object] = {"available": True, "torch cuda": torch.version.cuda,
                                 "devices": torch.cuda.device_count()}
    try:
        report["driver"] = _driver_version()
    except Exception as exc:  # the report must print even on an odd install
        report["driver"] = f"unknown ({exc})"
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        report[f"cuda:{i}"] = (f"{props.name}, compute capability {props.major}.{props.minor}, "
                               f"{total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    return report


def _driver_version() -> str:
    try:
        import pynvml  # nvidia-ml-py, where installed

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        code = int(torch._C._cuda_getDriverVersion())  # e.g. 13000: the CUDA version the driver supports
        return f"supports CUDA {code // 1000}.{code % 1000 // 10}"
