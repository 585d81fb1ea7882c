"""Run libcapstan's scalar kernels on aarch64 under qemu-user and compare with the host.

Builds tools/native_parity_harness.cc twice, linked with the library's object
files: for the host (every ISA it compiles) with the system compiler, and for
aarch64-linux-musl, statically, with zig c++ (the ziglang wheel; musl because
a static executable needs no aarch64 sysroot). Runs the host one for each ISA
this CPU supports and the aarch64 one under qemu-aarch64, and fails unless
every Adam/cast result hash is identical, the aarch64 build reports no CPU
features, only the scalar ISA compiled, and refuses avx2.

qemu-user is not a dependency of the project (no PyPI package carries it):
install it first, e.g. `apt-get install -y qemu-user`. Not part of the test
suite for that reason; native/tests/test_cross_build.py checks the aarch64
build itself on every run.

    hatch run python tools/check_native_aarch64.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "native"))
import build_native  # noqa: E402

HARNESS = ROOT / "tools" / "native_parity_harness.cc"
TARGET = "aarch64-linux-musl"


def build_harness(work: Path, target: str | None, static: bool) -> Path:
    work.mkdir(parents=True)
    cmd, objs = build_native.compile_objects(work, target=target)
    exe = work / "harness"
    build_native._run([*cmd, "-I", str(build_native.CSRC), str(HARNESS), *objs, "-o", str(exe),
                       "-pthread", *(["-static"] if static else [])])
    return exe


def run(cmd: list[str]) -> tuple[int, dict[str, str], list[str]]:
    """(exit code, identity lines, result lines) of one harness run."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    ident = dict(line[1:].split(" ", 1) for line in lines if line.startswith("#"))
    results = [line for line in lines if not line.startswith("#")]
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
    return proc.returncode, ident, results


def main() -> int:
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if qemu is None:
        print("check_native_aarch64: qemu-aarch64 not found; install qemu-user "
              "(apt-get install -y qemu-user)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="capstan-aarch64-") as tmp:
        host = build_harness(Path(tmp) / "host", None, static=False)
        arm = build_harness(Path(tmp) / "aarch64", TARGET, static=True)

        reference: list[str] | None = None
        ran: list[str] = []
        for isa in ("scalar", "avx2", "avx512", "avx512bf16"):
            rc, _ident, results = run([str(host), isa])
            if rc == 3:  # not compiled in or not supported by this CPU
                continue
            reference = reference if reference is not None else results
            if results != reference:
                print(f"host {isa} differs from host scalar", file=sys.stderr)
                return 1
            ran.append(f"host-{isa}")
        assert reference, "the host harness ran no ISA"

        rc, ident, results = run([qemu, str(arm)])
        assert rc == 0, rc
        problems = []
        if ident.get("features") != "0":
            problems.append(f"aarch64 capstan_cpu_features() = {ident.get('features')}, want 0")
        if ident.get("compiled") != "1":
            problems.append(f"aarch64 capstan_compiled_isas() = {ident.get('compiled')}, want 1")
        if ident.get("isa") != "scalar":
            problems.append(f"aarch64 chose ISA {ident.get('isa')}, want scalar")
        if run([qemu, str(arm), "avx2"])[0] != 3:
            problems.append("aarch64 accepted capstan_set_isa(avx2)")
        diff = [(a, b) for a, b in zip(reference, results, strict=False) if a != b]
        if len(results) != len(reference) or diff:
            problems.append(f"aarch64 results differ from the host's: {diff[:5]} "
                            f"({len(results)} vs {len(reference)} lines)")
        for p in problems:
            print(f"check_native_aarch64: {p}", file=sys.stderr)
        if problems:
            return 1
        print(f"check_native_aarch64: {len(results)} Adam/cast result hashes identical across "
              f"{', '.join(ran)} and aarch64 (qemu, scalar; features 0, compiled scalar only)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
