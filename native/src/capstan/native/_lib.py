"""Find, load and declare libcapstan (ctypes).

The library is looked up at `$CAPSTAN_NATIVE_LIB` if set (another build, e.g.
the sanitizer build), else at `lib/libcapstan.so` beside this file, where the
hatch build hook puts it for wheels and editable installs alike. Imported from
a source checkout (an editable install), the loader first (re)builds that
library when it is missing or its build record names other sources: an
environment that outlives its checkout (a CI cache, `git clean`, a pull that
changed csrc/) would otherwise load nothing, or a stale library.
`CAPSTAN_NATIVE_BUILD=0` turns that off. Loading checks
the ABI version and the CPU feature probe, declares every function's
argtypes/restype once (csrc/capstan.h is the reference), sizes the thread pool
and applies `CAPSTAN_NATIVE_ISA`. If any of that fails, `get()` returns None,
one warning names the reason, and the kernels use the pure-torch fallback.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib.util
import json
import os
import sys
import threading
import warnings
from ctypes import POINTER, c_char_p, c_double, c_int, c_int64, c_uint32, c_uint64, c_void_p
from pathlib import Path

__all__ = ["ABI_VERSION", "DTYPE_CODES", "ISA_NAMES", "NativeError", "get", "load_error",
           "library_path", "check"]

ABI_VERSION = 5  # must equal CAPSTAN_ABI_VERSION in csrc/capstan.h
LIB_DIR = Path(__file__).resolve().parent / "lib"
# native/ of a source checkout (this file is native/src/capstan/native/_lib.py there);
# an installed wheel has no build_native.py at this place.
CHECKOUT = Path(__file__).resolve().parents[3]
ISA_NAMES = ("scalar", "avx2", "avx512", "avx512bf16")
# torch dtype name -> CAPSTAN_F32 / CAPSTAN_BF16 / CAPSTAN_F16
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
NONE = -1

_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "capstan_abi_version": (c_int, []),
    "capstan_cpu_features": (c_uint32, []),
    "capstan_compiled_isas": (c_uint32, []),
    "capstan_best_isa": (c_int, []),
    "capstan_set_isa": (c_int, [c_int]),
    "capstan_get_isa": (c_int, []),
    "capstan_isa_name": (c_char_p, [c_int]),
    "capstan_set_num_threads": (c_int, [c_int]),
    "capstan_get_num_threads": (c_int, []),
    "capstan_strerror": (c_char_p, [c_int]),
    "capstan_adam_step": (c_int, [c_void_p, c_int, c_void_p, c_int, c_void_p, c_void_p, c_int, c_uint64,
                                  c_int64, c_int64, c_int64, c_double, c_double, c_double, c_double, c_double,
                                  c_int, c_double, c_int, c_void_p, c_int, POINTER(c_int)]),
    "capstan_adam_step_q8": (c_int, [c_void_p, c_int, c_void_p, c_int, c_void_p, c_void_p, c_void_p, c_void_p,
                                     c_int64, c_int, c_void_p, c_void_p, c_void_p, c_uint64, c_int64, c_double,
                                     c_double, c_double, c_double, c_double, c_int, c_double, c_int, c_void_p,
                                     c_int, POINTER(c_int)]),
    "capstan_cast": (c_int, [c_void_p, c_int, c_void_p, c_int, c_int64]),
    "capstan_copy": (c_int, [c_void_p, c_void_p, c_int64]),
    "capstan_sum": (c_int, [c_void_p, c_int, POINTER(c_void_p), c_int, c_int, c_int64]),
    "capstan_sumsq": (c_int, [c_void_p, c_int, c_int64, POINTER(c_double)]),
    "capstan_nonfinite": (c_int, [c_void_p, c_int, c_int64, POINTER(c_int)]),
    "capstan_alloc_aligned": (c_void_p, [c_int64, c_int64]),
    "capstan_free_aligned": (None, [c_void_p]),
    "capstan_file_open": (c_int, [c_char_p, c_int, c_int, POINTER(c_int), POINTER(c_int),
                                  POINTER(c_int)]),
    "capstan_file_close": (c_int, [c_int, POINTER(c_int)]),
    "capstan_aio_create": (c_int, [c_int, POINTER(c_void_p)]),
    "capstan_aio_destroy": (c_int, [c_void_p]),
    "capstan_aio_submit": (c_int, [c_void_p, c_int, c_int, c_void_p, c_int64, c_int64,
                                   POINTER(c_int64)]),
    "capstan_aio_poll": (c_int, [c_void_p, c_int64, POINTER(c_int)]),
    "capstan_aio_wait": (c_int, [c_void_p, c_int64, POINTER(c_int64), POINTER(c_int)]),
}


class NativeError(RuntimeError):
    """A libcapstan call returned an error code the Python checks should have prevented."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_tried = False


def library_path() -> Path:
    env = os.environ.get("CAPSTAN_NATIVE_LIB")
    return Path(env) if env else LIB_DIR / "libcapstan.so"


def _default_threads() -> int:
    env = os.environ.get("CAPSTAN_NATIVE_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if not 1 <= n <= 1024:
            raise ValueError(f"CAPSTAN_NATIVE_THREADS={env!r}: expected an integer in 1..1024")
        return n
    try:
        import torch
    except ImportError:
        return max(1, os.cpu_count() or 1)
    return max(1, min(1024, torch.get_num_threads()))


def _builder():
    """native/build_native.py of this checkout as a module, or None outside a checkout."""
    script = CHECKOUT / "build_native.py"
    if not (script.is_file() and (CHECKOUT / "csrc").is_dir()):
        return None
    spec = importlib.util.spec_from_file_location("_capstan_build_native", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stale(builder) -> str | None:
    """Why lib/ must be (re)built from the checkout's sources, or None when it is current."""
    if not (LIB_DIR / "libcapstan.so").exists():
        return "not built yet"
    try:
        info = json.loads((LIB_DIR / "build_info.json").read_text())
        recorded, opt = info.get("sources"), info.get("opt", "3")  # (records before "opt" were -O3 builds)
    except (OSError, ValueError, AttributeError):
        return "no build record"
    if recorded != builder.source_digest():
        return "the sources changed since it was built"
    wanted = builder.opt_level()
    return None if opt == wanted else f"built at -O{opt}, CAPSTAN_NATIVE_OPT asks for -O{wanted}"


def ensure_built() -> None:
    """In a source checkout, build lib/libcapstan.so when it is missing or stale. One process builds; concurrent ranks
    wait on a lock file and then find it current. Raises OSError naming the failure."""
    if "CAPSTAN_NATIVE_LIB" in os.environ or os.environ.get("CAPSTAN_NATIVE_BUILD", "1") == "0":
        return
    builder = _builder()
    if builder is None or _stale(builder) is None:
        return
    try:
        LIB_DIR.mkdir(parents=True, exist_ok=True)
        with open(LIB_DIR / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            reason = _stale(builder)
            if reason is None:
                return
            print(f"capstan.native: building {LIB_DIR / 'libcapstan.so'} from {CHECKOUT} "
                  f"({reason})", file=sys.stderr, flush=True)
            builder.build_all(LIB_DIR)
    except (OSError, RuntimeError) as exc:
        raise OSError(f"building it from {CHECKOUT} failed: {str(exc)[-2000:]}") from exc


def _load() -> ctypes.CDLL:
    ensure_built()
    path = library_path()
    if not path.exists():
        hint = ("CAPSTAN_NATIVE_LIB points at a missing file" if "CAPSTAN_NATIVE_LIB" in os.environ
                else "build it with `python native/build_native.py` or reinstall capstan-native")
        raise OSError(f"{path} not found ({hint})")
    lib = ctypes.CDLL(str(path))
    lib.capstan_abi_version.restype = c_int
    lib.capstan_abi_version.argtypes = []
    version = lib.capstan_abi_version()
    if version != ABI_VERSION:
        raise OSError(f"{path} has ABI version {version}, this binding needs {ABI_VERSION}")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    features = lib.capstan_cpu_features()
    compiled = lib.capstan_compiled_isas()
    if not compiled & 1:
        raise OSError(f"{path} reports no scalar kernels (compiled ISA mask {compiled:#x})")
    check(lib, lib.capstan_set_num_threads(_default_threads()), "capstan_set_num_threads")
    isa = os.environ.get("CAPSTAN_NATIVE_ISA")
    if isa:
        code = ISA_NAMES.index(isa) if isa in ISA_NAMES else -1
        if code < 0 or lib.capstan_set_isa(code) != 0:
            best = ISA_NAMES[lib.capstan_best_isa()]
            warnings.warn(f"CAPSTAN_NATIVE_ISA={isa!r} is not usable here (expected one of "
                          f"{', '.join(ISA_NAMES)}, compiled in and supported by this CPU: "
                          f"features {features:#x}); using {best}", RuntimeWarning, stacklevel=3)
    return lib


def get() -> ctypes.CDLL | None:
    """The loaded library, or None (with one warning) when it cannot be used."""
    global _lib, _error, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _load()
            except (OSError, AttributeError, ValueError) as exc:
                _error = str(exc)
                warnings.warn(f"capstan.native: library not loaded ({_error}); using the "
                              "pure-torch fallback kernels", RuntimeWarning, stacklevel=2)
            _tried = True
    return _lib


def load_error() -> str | None:
    get()
    return _error


def check(lib: ctypes.CDLL, code: int, what: str) -> None:
    """Raise NativeError for a non-zero return code."""
    if code != 0:
        msg = lib.capstan_strerror(code).decode()
        raise NativeError(f"{what} failed: {msg} (code {code})")
