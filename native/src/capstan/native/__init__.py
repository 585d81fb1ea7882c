"""capstan.native: the shared C/C++ library (libcapstan) and its ctypes binding.

Submodules: `kernels` (Adam/AdamW step, casts, copies, reductions on torch
tensors), `optim` (`CPUAdam`), `aio` (async file I/O for the disk tier),
`fallback` (pure-torch versions of every kernel), `device_ops` (the same
calls on accelerator tensors through torch's kernels), `standin` (the CPU
suite's stand-in accelerator).
`status()` says what is built and loaded; `capstan info` prints it.
See docs/native.md.
"""

from __future__ import annotations

import json

from . import _lib

__all__ = ["status", "available"]


def available() -> bool:
    """True if libcapstan is loaded (otherwise kernels run the pure-torch fallback)."""
    return _lib.get() is not None


def _build_info(directory) -> dict[str, object]:
    try:
        return json.loads((directory / "build_info.json").read_text())
    except (OSError, ValueError):
        return {}


def status() -> dict[str, object]:
    """What `capstan info` prints about the native library (never raises)."""
    lib = _lib.get()  # first: loading may build the library and its build_info.json
    path = _lib.library_path()
    info = _build_info(path.parent)
    out: dict[str, object] = {"library": str(path), "built": path.exists(),
                              "loaded": lib is not None}
    if lib is None:
        out["reason"] = _lib.load_error()
        out["using"] = "pure-torch fallback"
    else:
        compiled = lib.capstan_compiled_isas()
        out.update({
            "abi version": lib.capstan_abi_version(),
            "isa": _lib.ISA_NAMES[lib.capstan_get_isa()],
            "isas compiled": [n for i, n in enumerate(_lib.ISA_NAMES) if compiled >> i & 1],
            "cpu features": f"{lib.capstan_cpu_features():#x}",
            "threads": lib.capstan_get_num_threads(),
        })
    if info.get("sanitize"):
        out["sanitize"] = True
    return out
