"""libcapstan cross-compiles for aarch64 (scalar kernels only) and exports the whole C ABI.

Compiles with zig c++ from the ziglang wheel (a declared dev dependency), so it
runs on any x86-64 dev machine or CI. It checks the build, not the behaviour:
nothing here runs aarch64 code (tools/check_native_aarch64.sh does, under
qemu-user, when that is installed).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import build_native  # native/, put on sys.path by conftest.py

HEADER = Path(build_native.CSRC) / "capstan.h"
EM_AARCH64, EM_X86_64 = 183, 62
ET_DYN, SHT_DYNSYM = 3, 11


def read_elf(path: Path) -> tuple[int, int, set[str]]:
    """(e_type, e_machine, names of defined global dynamic symbols) of a 64-bit LE ELF."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF", "not an ELF file"
    assert data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF"
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    e_shoff, = struct.unpack_from("<Q", data, 40)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 58)
    # Section header: name, type, flags, addr, offset, size, link, info, align, entsize.
    shdrs = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize)
             for i in range(e_shnum)]
    names: set[str] = set()
    for sh in shdrs:
        if sh[1] != SHT_DYNSYM:
            continue
        off, size, entsize = sh[4], sh[5], sh[9]
        strtab = shdrs[sh[6]]
        for i in range(size // entsize):
            st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", data, off + i * entsize)
            if st_shndx == 0 or (st_info >> 4) not in (1, 2):  # undefined, or not GLOBAL/WEAK
                continue
            start = strtab[4] + st_name
            names.add(data[start:data.index(b"\0", start)].decode())
    return e_type, e_machine, names


def abi_functions() -> set[str]:
    """Every function capstan.h declares with CAPSTAN_API."""
    return set(re.findall(r"CAPSTAN_API\s[^;(]*?\b(capstan_\w+)\s*\(", HEADER.read_text()))


def test_target_decides_the_isa_units():
    assert build_native.target_arch("aarch64-linux-gnu") == "aarch64"
    assert build_native.target_arch("arm64-macos") == "aarch64"
    assert not build_native._is_x86_64("aarch64-linux-gnu")
    assert build_native._is_x86_64("x86_64-linux-gnu")


def test_libcapstan_cross_compiles_for_aarch64(tmp_path: Path):
    # -Werror: the scalar-only sources must compile without a warning for aarch64. Linked without
    # zig's libc++ (its first build for a target takes over a minute and checks nothing of ours).
    lib = build_native.build_cpu(tmp_path, target="aarch64-linux-gnu", werror=True, cxx_runtime=False)
    e_type, e_machine, exported = read_elf(lib)
    assert e_type == ET_DYN
    assert e_machine == EM_AARCH64, f"e_machine {e_machine}, expected EM_AARCH64"
    wanted = abi_functions()
    assert len(wanted) >= 25, wanted  # the header parse found the ABI
    assert wanted <= exported, f"not exported: {sorted(wanted - exported)}"
    # -fvisibility=hidden: nothing but the C ABI leaks out.
    assert not {n for n in exported if "kernels_" in n}, "internal kernel tables exported"

