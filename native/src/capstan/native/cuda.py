"""ctypes binding of libcapstan_cuda: pinned host buffers, async copies on a stream, casts.

Loaded only when torch.cuda.is_available() and the library was built (nvcc
present at build time); `loaded()` says whether it is. On a machine without a
GPU every function raises RuntimeError naming why. Streams are torch streams
(their `cuda_stream` handle goes to the library), so copies order with torch
work on the same stream.

Example (GPU machines)::

    host = pinned_empty(1 << 20, torch.bfloat16)
    dev = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    copy_async(dev, host, s)
    torch.cuda.current_stream().wait_stream(s)
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, c_char_p, c_int, c_int64, c_void_p

from . import _lib

__all__ = ["loaded", "load_error", "pinned_empty", "copy_async", "cast_async"]

ABI_VERSION = 1
_SIGNATURES = {
    "capstan_cuda_abi_version": (c_int, []),
    "capstan_cuda_strerror": (c_char_p, [c_int]),
    "capstan_cuda_device_count": (c_int, [POINTER(c_int)]),
    "capstan_cuda_host_alloc": (c_int, [c_int64, POINTER(c_void_p)]),
    "capstan_cuda_host_free": (c_int, [c_void_p]),
    "capstan_cuda_memcpy_async": (c_int, [c_void_p, c_void_p, c_int64, c_int, c_void_p]),
    "capstan_cuda_cast": (c_int, [c_void_p, c_int, c_void_p, c_int, c_int64, c_void_p]),
}
_lock = threading.Lock()
_state: dict[str, object] = {}


def _load() -> ctypes.CDLL:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    path = _lib.library_path().parent / "libcapstan_cuda.so"
    if not path.exists():
        raise RuntimeError(f"{path} not built (nvcc was not found or failed at build time)")
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = argtypes
    if lib.capstan_cuda_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {lib.capstan_cuda_abi_version()} != {ABI_VERSION}")
    return lib


def _get() -> ctypes.CDLL:
    with _lock:
        if not _state:
            try:
                _state["lib"] = _load()
            except (OSError, RuntimeError) as exc:
                _state["error"] = str(exc)
    if "lib" not in _state:
        raise RuntimeError(f"capstan CUDA library unavailable: {_state['error']}")
    return _state["lib"]  # type: ignore[return-value]


def loaded() -> bool:
    try:
        _get()
    except RuntimeError:
        return False
    return True


def load_error() -> str | None:
    return None if loaded() else str(_state.get("error"))


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what} failed: {lib.capstan_cuda_strerror(code).decode()}")


class _PinnedBlock:
    def __init__(self, lib: ctypes.CDLL, nbytes: int):
        self._lib, ptr = lib, c_void_p()
        _check(lib, lib.capstan_cuda_host_alloc(nbytes, ctypes.byref(ptr)), "cudaHostAlloc")
        self.ptr = ptr.value
        self.__array_interface__ = {"data": (self.ptr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def __del__(self):
        if getattr(self, "ptr", None):
            self._lib.capstan_cuda_host_free(self.ptr)
            self.ptr = None


def pinned_empty(numel: int, dtype=None):
    """Uninitialized 1-D page-locked cpu tensor (default uint8)."""
    import numpy as np
    import torch

    dtype = dtype or torch.uint8
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be an int >= 1, got {numel!r}")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.asarray(_PinnedBlock(_get(), nbytes))).view(dtype)


def _stream_handle(stream) -> int:
    import torch

    s = stream if stream is not None else torch.cuda.current_stream()
    return s.cuda_stream


def copy_async(dst, src, stream=None) -> None:
    """dst[:] = src on `stream` (host<->device or device<->device); contiguous, same bytes."""
    from .kernels import check_tensor

    lib = _get()
    for name, t in (("dst", dst), ("src", src)):
        if not hasattr(t, "is_cuda"):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(f"dst ({dst.dtype}, {dst.numel()}) and src ({src.dtype}, "
                         f"{src.numel()}) must have the same dtype and size")
    if not dst.is_cuda and not src.is_cuda:
        raise ValueError("dst or src must be a cuda tensor")
    if not src.is_cuda:
        check_tensor("src", src, (src.dtype,))
    kind = 0 if not src.is_cuda else (1 if not dst.is_cuda else 2)
    nbytes = src.numel() * src.element_size()
    _check(lib, lib.capstan_cuda_memcpy_async(dst.data_ptr(), src.data_ptr(), nbytes, kind,
                                              _stream_handle(stream)), "cudaMemcpyAsync")


def cast_async(src, dst, stream=None) -> None:
    """dst[:] = src converted (fp32/bf16/fp16, round to nearest even) on cuda tensors."""
    lib = _get()
    for name, t in (("src", src), ("dst", dst)):
        if not getattr(t, "is_cuda", False):
            raise ValueError(f"{name} must be a cuda torch.Tensor")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if str(t.dtype).removeprefix("torch.") not in _lib.DTYPE_CODES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected float32, bfloat16, float16")
    if src.numel() != dst.numel():
        raise ValueError(f"dst has {dst.numel()} elements, src has {src.numel()}")
    code = lambda t: _lib.DTYPE_CODES[str(t.dtype).removeprefix("torch.")]  # noqa: E731
    _check(lib, lib.capstan_cuda_cast(src.data_ptr(), code(src), dst.data_ptr(), code(dst),
                                      src.numel(), _stream_handle(stream)), "capstan_cuda_cast")
