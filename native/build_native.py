"""Compile libcapstan with the system compiler.

Used by the hatch build hook (hatch_build.py) for wheels and editable installs,
and directly for development and sanitizer builds:

    python native/build_native.py                 # rebuild into src/capstan/native/lib/
    CAPSTAN_NATIVE_SANITIZE=1 python native/build_native.py --out build/asan
                                                  # ASan+UBSan build for tools/check_native_sanitize.sh
    python native/build_native.py --target aarch64-linux-gnu --out build/aarch64
                                                  # cross build (zig c++ from the ziglang wheel)

No dependency beyond the standard library, so it runs in hatchling's isolated
build environment. One translation unit per instruction set: only
kernels_avx2.cc gets -mavx2 -mfma -mf16c and only kernels_avx512.cc gets the
AVX-512 flags; never -march=native, so the library runs on any x86-64 and the
dispatcher (csrc/dispatch.cc) picks the kernels at run time.

The ISA units are chosen by the *target* architecture, which is the host's
unless a target triple is given (--target, or CAPSTAN_NATIVE_TARGET, e.g.
aarch64-linux-gnu): any other architecture gets the scalar kernels only. For
a target the compiler is CAPSTAN_NATIVE_TARGET_CXX if set (split like a shell
word list; CXX is for the host only), else `<triple>-g++` if installed, else
`python -m ziglang c++ -target <triple>`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
DEFAULT_OUT = HERE / "src" / "capstan" / "native" / "lib"

COMMON = ["api.cc", "dispatch.cc", "threadpool.cc", "aio.cc", "kernels_scalar.cc"]
ISA_UNITS = {
    "avx2": ("kernels_avx2.cc", ["-mavx2", "-mfma", "-mf16c"]),
    "avx512": ("kernels_avx512.cc", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"]),
    "avx512bf16": ("kernels_avx512bf16.cc", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                                             "-mavx512bf16", "-mfma", "-mf16c"]),
}
# -ffp-contract=off: no implicit FMA, so scalar, AVX2 and AVX-512 kernels run
# the same IEEE operations and agree bit for bit. -fno-math-errno lets sqrt
# compile to the instruction. Never -ffast-math (changes results vs torch).
BASE_FLAGS = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off",
              "-fno-math-errno", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread"]
OPT_LEVELS = ("0", "1", "2", "3", "s", "g")


def opt_level() -> str:
    """The optimization level of a (non-sanitizer) build: CAPSTAN_NATIVE_OPT, default "3".

    A lower level is for tests of the build itself (tests/test_checkout_build.py builds at
    -O0 in a fifth of the time); build_info.json records it, and capstan.native's loader
    rebuilds a library whose recorded level is not the one asked for.
    """
    level = os.environ.get("CAPSTAN_NATIVE_OPT", "3")
    if level not in OPT_LEVELS:
        raise ValueError(f"CAPSTAN_NATIVE_OPT={level!r}: expected one of {', '.join(OPT_LEVELS)}")
    return level


def _target(target: str | None) -> str | None:
    """The target triple asked for (argument, else CAPSTAN_NATIVE_TARGET), None for the host."""
    return target or os.environ.get("CAPSTAN_NATIVE_TARGET") or None


def target_arch(target: str | None = None) -> str:
    """Architecture the library is built for: the triple's first field, else the host's."""
    target = _target(target)
    arch = target.split("-", 1)[0] if target else platform.machine()
    arch = arch.lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def _is_x86_64(target: str | None = None) -> bool:
    return target_arch(target) == "x86_64"


def _zig_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("ziglang") is not None


def _compiler(target: str | None = None) -> list[str]:
    """The C++ compiler command (a word list) for the host or for a target triple."""
    target = _target(target)
    if target is None:
        if os.environ.get("CXX"):
            return shlex.split(os.environ["CXX"])
        cxx = shutil.which("g++") or shutil.which("c++")
        if not cxx:
            raise RuntimeError("capstan-native: no C++ compiler found (set CXX or install g++)")
        return [cxx]
    # Not CXX: a CXX meant for the host would silently build for the host.
    if os.environ.get("CAPSTAN_NATIVE_TARGET_CXX"):
        return shlex.split(os.environ["CAPSTAN_NATIVE_TARGET_CXX"])
    cross = shutil.which(f"{target}-g++")
    if cross:
        return [cross]
    if _zig_available():
        return [sys.executable, "-m", "ziglang", "c++", "-target", target]
    raise RuntimeError(f"capstan-native: no C++ compiler for target {target!r} "
                       f"(set CAPSTAN_NATIVE_TARGET_CXX, install {target}-g++, "
                       f"or pip install ziglang)")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout}{proc.stderr}")


# What each ISA unit's code needs of the CPU (Linux /proc/cpuinfo flag names).
ISA_CPU_FLAGS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "f16c"},
                 "avx512bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "f16c"}}


def isa_units(target: str | None = None, sanitize: bool = False,
              cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The ISA units a build compiles: every x86-64 one, none for another architecture; a sanitizer
    build (host only) leaves out those the host CPU cannot run, since its only use is running the tests
    here and a unit that never runs checks nothing (an AVX2 host saved the two AVX-512 units' compile
    time in every suite run: tests/test_sanitized_build.py)."""
    if not _is_x86_64(target):
        return []
    if not sanitize:
        return list(ISA_UNITS)
    try:
        flags = {f for line in cpuinfo.read_text().splitlines() if line.startswith("flags")
                 for f in line.split(":", 1)[1].split()}
    except OSError:
        return list(ISA_UNITS)  # no /proc (not Linux): build them all
    return [isa for isa in ISA_UNITS if ISA_CPU_FLAGS[isa] <= flags]


def compile_objects(obj_dir: Path, sanitize: bool = False, jobs: int = 2,
                    target: str | None = None, werror: bool = False) -> tuple[list[str], list[str]]:
    """Compile every unit for the target into obj_dir; returns (compiler + flags, objects).

    target: a triple such as "aarch64-linux-gnu" to cross-compile (default: the host,
    or CAPSTAN_NATIVE_TARGET). werror: turn warnings into errors (the cross-build test).
    The ISA units and their CAPSTAN_HAVE_* defines follow the target's architecture.
    """
    cxx = _compiler(target)
    flags = list(BASE_FLAGS)
    if werror:
        flags.append("-Werror")
    if sanitize and _target(target):
        raise ValueError("capstan-native: a sanitizer build is for the host only, not a target")
    if sanitize:
        # -O0 and line tables only (-g1): every access instrumented as written, stack traces with file and
        # line, and the AVX2 unit compiled in 8 s instead of 38 s at -O1 -g (the suite's ASan test: build
        # 10 s instead of 36, its child run 50 s instead of 47). UBSan's object-size check needs the
        # optimizer's object sizes and checks nothing at -O0; ASan still catches heap and stack overruns.
        flags += ["-O0", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=undefined"]
    else:
        flags += [f"-O{opt_level()}"]
    units: list[tuple[str, list[str]]] = [(u, []) for u in COMMON]
    defines: list[str] = []
    for isa in isa_units(target, sanitize):
        unit, isa_flags = ISA_UNITS[isa]
        units.append((unit, isa_flags))
        defines.append(f"-DCAPSTAN_HAVE_{isa.upper()}")

    def compile_one(item: tuple[str, list[str]]) -> str:
        unit, extra = item
        obj = str(obj_dir / (unit + ".o"))
        _run([*cxx, *flags, *defines, *extra, "-I", str(CSRC), "-c", str(CSRC / unit), "-o", obj])
        return obj

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        objs = list(pool.map(compile_one, units))
    return [*cxx, *flags], objs


def build_cpu(out_dir: Path, sanitize: bool = False, jobs: int = 2, target: str | None = None,
              werror: bool = False, cxx_runtime: bool = True) -> Path:
    """Compile and link libcapstan.so into out_dir; returns its path (arguments as
    compile_objects).

    cxx_runtime=False links without the C++ standard library (-nostdlib++), leaving its
    symbols undefined: a library to inspect, not to load. A zig cross build otherwise
    compiles zig's libc++ for the target first, over a minute on a 2-core machine with an
    empty cache, which is all a check of our own sources (tests/test_cross_build.py) would
    spend its time on."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="capstan-build-") as tmp:
        cmd, objs = compile_objects(Path(tmp), sanitize=sanitize, jobs=jobs, target=target,
                                    werror=werror)
        lib = out_dir / "libcapstan.so"
        tmp_lib = Path(tmp) / "libcapstan.so"
        _run([*cmd, "-shared", *objs, "-o", str(tmp_lib), "-pthread", *([] if cxx_runtime else ["-nostdlib++"])])
        # Replace atomically: a running process may have the old file mapped.
        shutil.copy2(tmp_lib, out_dir / ".libcapstan.so.tmp")
        os.replace(out_dir / ".libcapstan.so.tmp", lib)
    return lib


def source_digest() -> str:
    """sha256 over every file the library is built from (csrc/, this script).

    build_info.json records it; capstan.native's loader rebuilds a checkout's
    library whose record differs, so a pull or an edit of the C sources never
    leaves a stale library behind the Python binding.
    """
    h = hashlib.sha256()
    files = [f for f in CSRC.rglob("*") if f.is_file()]
    for f in sorted(files) + [Path(__file__).resolve()]:
        h.update(f.relative_to(HERE).as_posix().encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()


def build_all(out_dir: Path = DEFAULT_OUT, sanitize: bool | None = None,
              jobs: int = 2, target: str | None = None) -> dict[str, object]:
    """Build the library into out_dir and write build_info.json beside it."""
    if sanitize is None:
        sanitize = os.environ.get("CAPSTAN_NATIVE_SANITIZE", "0") == "1"
    target = _target(target)
    lib = build_cpu(out_dir, sanitize=sanitize, jobs=jobs, target=target)
    # libcapstan_cuda was removed (docs/native.md): a copy left by an older build must not be
    # shipped in a wheel (hatch_build.py includes every .so here) nor mistaken for a current one.
    (out_dir / "libcapstan_cuda.so").unlink(missing_ok=True)
    info: dict[str, object] = {
        "compiler": shlex.join(_compiler(target)),
        "machine": target_arch(target),
        "target": target,
        "isas": ["scalar", *isa_units(target, sanitize)],
        "sanitize": sanitize,
        "opt": opt_level(),
        "library": lib.name,
        "sources": source_digest(),
    }
    # Atomically, after the library: a loader that finds this record current may trust the .so.
    (out_dir / ".build_info.json.tmp").write_text(json.dumps(info, indent=2) + "\n")
    os.replace(out_dir / ".build_info.json.tmp", out_dir / "build_info.json")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    ap.add_argument("--sanitize", action="store_true", help="ASan + UBSan build")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--target", default=None,
                    help="target triple to cross-compile for, e.g. aarch64-linux-gnu "
                         "(default: CAPSTAN_NATIVE_TARGET, else the host)")
    args = ap.parse_args(argv)
    if _target(args.target) and args.out == DEFAULT_OUT:
        ap.error("a cross build needs --out (the default directory holds the host library)")
    info = build_all(args.out, sanitize=args.sanitize or None, jobs=args.jobs, target=args.target)
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
