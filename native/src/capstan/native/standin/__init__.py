"""A second device that is not the CPU, for the CPU test suite: ``standin``.

``load()`` compiles ``standin.cc`` and ``memory.cc`` against the installed torch (once; cached
by source, torch version and compiler), loads it as torch's PrivateUse1
backend and names it ``standin``. Tensors then live on ``standin:0``,
``standin:1``, ... in host memory, report that device, and refuse to be mixed
with CPU tensors the way CUDA tensors do, so a missing ``.to(device)`` fails in
CI as it would on a GPU. The device-generic APIs work on it:
``torch.accelerator`` (current device and stream, memory statistics),
``torch.Stream`` / ``torch.Event``, ``torch.Tensor.pin_memory()`` (pinned
blocks come from a caching host allocator that rounds to powers of two, as
CUDA's does), and ``torch.standin`` (this module's `device_module`) for the
calls capstan's device code makes through ``torch.get_device_module``.

Ops run on the host when called (streams order nothing; events complete at
once), through the CPU kernels, so a run on the stand-in computes the CPU's
values: parity against the CPU holds to the bit, which is what the suite
checks. What it cannot show (real overlap, NCCL, a GPU's speed, TF32) is for
the GPU battery (docs/gpu.md).

Environment: ``CAPSTAN_STANDIN_DEVICES`` (default 2) and
``CAPSTAN_STANDIN_MEMORY`` (bytes per device, default 64 GiB; more raises
``torch.OutOfMemoryError``), read when the library loads;
``CAPSTAN_STANDIN_CACHE`` (where the compiled library is kept, default
``~/.cache/capstan/standin``).

    from capstan.native import standin
    dev = standin.load()            # "standin"
    x = torch.ones(4, device=dev)   # standin:0
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["NAME", "load", "loaded", "available", "param", "host_syncs", "device_stats", "host_stats",
           "empty_host_cache", "late_events", "requires", "StandinUnavailable"]

NAME = "standin"
_HERE = Path(__file__).parent
_SOURCES = (_HERE / "standin.cc", _HERE / "memory.cc")  # one shared library; standin.h between them
_lib: ctypes.CDLL | None = None


class StandinUnavailable(RuntimeError):
    """The stand-in device cannot be built here (no compiler, or torch without its headers)."""


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _library_path() -> Path:
    """Where the compiled library for this source, torch and compiler is cached."""
    key = hashlib.sha256()
    for path in (*_SOURCES, _HERE / "standin.h"):
        key.update(path.read_bytes())
    key.update(torch.__version__.encode())
    key.update(_compiler().encode())
    key.update(sys.version.encode())
    root = Path(os.environ.get("CAPSTAN_STANDIN_CACHE", Path.home() / ".cache" / "capstan" / "standin"))
    return root / key.hexdigest()[:16] / "libcapstan_standin.so"


def _build(out: Path) -> None:
    """Compile against the installed torch's headers and libraries (about 15 s on 2 cores)."""
    from torch.utils import cpp_extension

    out.parent.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dir = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [_compiler(), "-std=c++17", "-O1", "-fPIC", "-shared", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *includes, f"-I{sysconfig.get_paths()['include']}", *map(str, _SOURCES), "-o", str(tmp),
           f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise StandinUnavailable(f"no C++ compiler ({_compiler()}): {exc}") from exc
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise StandinUnavailable(f"compiling the stand-in device failed:\n{done.stderr[-4000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders (ranks of one test) never load half a file


def available() -> bool:
    """Whether the stand-in can be had here: already built, or torch's C++ headers and a compiler."""
    from torch.utils import cpp_extension

    if _lib is not None or _library_path().exists():
        return True
    headers = any((Path(p) / "ATen" / "ATen.h").exists() for p in cpp_extension.include_paths())
    return headers and shutil.which(_compiler().split()[0]) is not None


def loaded() -> bool:
    return _lib is not None


def load() -> str:
    """Build (once) and load the stand-in; returns its device type name. Idempotent per process."""
    global _lib
    if _lib is not None:
        return NAME
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", NAME):
        raise StandinUnavailable(f"PrivateUse1 is taken by {torch._C._get_privateuse1_backend_name()!r}")
    path = _library_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then load its result
            if not path.exists():
                _build(path)
    torch.ops.load_library(str(path))
    lib = ctypes.CDLL(str(path))
    lib.capstan_standin_device_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.capstan_standin_host_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.capstan_standin_host_syncs.restype = ctypes.c_int64
    lib.capstan_standin_set_event_lag.argtypes = [ctypes.c_int]
    if lib.capstan_standin_abi_version() != 2:
        raise StandinUnavailable(f"{path}: unexpected ABI version {lib.capstan_standin_abi_version()}")
    if torch._C._get_privateuse1_backend_name() != NAME:
        torch.utils.rename_privateuse1_backend(NAME)
        from . import device_module

        device_module.bind(_device_count)
        torch._register_device_module(NAME, device_module)
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    _lib = lib
    return NAME


def requires():
    """A pytest mark skipping a test (with the reason) where the stand-in cannot be built."""
    import pytest

    return pytest.mark.skipif(not available(),
                              reason="the stand-in device needs torch's C++ headers and a C++ compiler")


def param():
    """A pytest parameter "standin" for tests parametrized over devices, skipped (with the reason) where the
    stand-in cannot be built; load it in the test (or a conftest fixture) with `load()`."""
    import pytest

    return pytest.param(NAME, id=NAME, marks=requires())


def _device_count() -> int:
    assert _lib is not None, "standin.load() first"
    return int(_lib.capstan_standin_device_count())


def device_stats(index: int = 0) -> dict[str, int]:
    """The device allocator's counters: allocated and reserved bytes (current and peak), allocations, OOMs."""
    assert _lib is not None, "standin.load() first"
    out = (ctypes.c_int64 * 6)()
    if _lib.capstan_standin_device_stats(index, out) != 0:
        raise ValueError(f"no standin device {index}")
    keys = ("allocated", "allocated_peak", "reserved", "reserved_peak", "allocations", "ooms")
    return dict(zip(keys, out))


def host_stats() -> dict[str, int]:
    """Pinned host memory: bytes in use (rounded to the block), their peak, reserved (in use + cached),
    its peak, and the bytes asked for."""
    assert _lib is not None, "standin.load() first"
    out = (ctypes.c_int64 * 5)()
    _lib.capstan_standin_host_stats(out)
    return dict(zip(("allocated", "allocated_peak", "reserved", "reserved_peak", "requested"), out))


def host_syncs() -> int:
    """How many times this process made the host wait for the device as a CUDA program would: `.item()`
    (and `float(t)`, `bool(t)`), a device->host copy that is blocking or lands in pageable memory, a
    host->device copy that is blocking or reads pageable memory. Tests hold hot paths to a count."""
    assert _lib is not None, "standin.load() first"
    return int(_lib.capstan_standin_host_syncs())


@contextmanager
def late_events(queries: int) -> Iterator[None]:
    """Events recorded inside answer "not done" to their first `queries` queries, until synchronized, as a
    GPU's copies in flight would (the stand-in's ops run at once, so its events are otherwise always
    done, and code that reads a buffer before its guarding event is done passes here and fails there).
    CAPSTAN_STANDIN_EVENT_LAG=n does the same for a whole process, the ranks of a launch included."""
    assert _lib is not None, "standin.load() first"
    before = int(os.environ.get("CAPSTAN_STANDIN_EVENT_LAG", "0") or 0)
    _lib.capstan_standin_set_event_lag(queries)
    try:
        yield
    finally:
        _lib.capstan_standin_set_event_lag(before)


def empty_host_cache() -> None:
    """Free the cached pinned blocks (as torch's caching host allocator does on request)."""
    assert _lib is not None, "standin.load() first"
    _lib.capstan_standin_empty_host_cache()
