"""A source checkout builds its own library on import when it is missing or stale.

CI keeps its hatch environment between runs but clones the repository afresh:
the editable install is not redone, so the library the install hook built is
gone. These tests copy native/ without its lib/ and import capstan.native from
the copy, as that environment does. They build at -O0 (CAPSTAN_NATIVE_OPT): what
they check is the build's bookkeeping, and an -O3 build of every ISA unit takes
five times as long.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capstan import native
from capstan.native import _lib

NATIVE = Path(__file__).resolve().parents[1]
STATUS = """
    from capstan import native
    st = native.status()
    print("LOADED", st["loaded"], st.get("library"))
"""


def checkout_copy(dest: Path) -> Path:
    """native/ without any built library, as a fresh clone has it."""
    for name in ("build_native.py", "csrc"):
        src = NATIVE / name
        if src.is_dir():
            shutil.copytree(src, dest / name)
        else:
            shutil.copy2(src, dest / name)
    shutil.copytree(NATIVE / "src", dest / "src",
                    ignore=shutil.ignore_patterns("lib", "__pycache__"))
    return dest


def import_from(copy: Path, code: str = STATUS, **env) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CAPSTAN_NATIVE")}
    base.update(PYTHONPATH=str(copy / "src"), CAPSTAN_NATIVE_OPT="0")
    base.update(env)
    return subprocess.Popen([sys.executable, "-W", "always", "-c", textwrap.dedent(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base)


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out, err


def test_missing_library_is_built_then_reused_then_rebuilt_after_an_edit(tmp_path):
    copy = checkout_copy(tmp_path)
    lib = copy / "src" / "capstan" / "native" / "lib" / "libcapstan.so"
    out, err = finish(import_from(copy))
    assert f"LOADED True {lib}" in out, out + err
    assert err.count("capstan.native: building") == 1 and "(not built yet)" in err, err

    out, err = finish(import_from(copy))
    assert f"LOADED True {lib}" in out and "building" not in err, err

    with open(copy / "csrc" / "api.cc", "a") as f:
        f.write("\n// an edit after the build\n")
    out, err = finish(import_from(copy))
    assert f"LOADED True {lib}" in out, out + err
    assert "(the sources changed since it was built)" in err, err
    assert '"opt": "0"' in (lib.parent / "build_info.json").read_text()


def test_a_library_built_at_another_level_is_stale(tmp_path, monkeypatch):
    class Builder:  # the two things _stale asks of build_native.py
        def source_digest(self):
            return "digest"

        def opt_level(self):
            return os.environ.get("CAPSTAN_NATIVE_OPT", "3")

    monkeypatch.setattr(_lib, "LIB_DIR", tmp_path)
    (tmp_path / "libcapstan.so").write_bytes(b"")
    (tmp_path / "build_info.json").write_text('{"sources": "digest", "opt": "0"}')
    monkeypatch.setenv("CAPSTAN_NATIVE_OPT", "0")
    assert _lib._stale(Builder()) is None
    monkeypatch.setenv("CAPSTAN_NATIVE_OPT", "1")
    assert _lib._stale(Builder()) == "built at -O0, CAPSTAN_NATIVE_OPT asks for -O1"
    (tmp_path / "build_info.json").write_text('{"sources": "digest"}')  # recorded before "opt": an -O3 build
    monkeypatch.delenv("CAPSTAN_NATIVE_OPT")
    assert _lib._stale(Builder()) is None
    monkeypatch.setenv("CAPSTAN_NATIVE_OPT", "fast")  # the real build script names the bad value
    with pytest.raises(ValueError, match="CAPSTAN_NATIVE_OPT='fast': expected one of 0, 1, 2, 3, s, g"):
        _lib._builder().opt_level()


def test_concurrent_ranks_build_once(tmp_path):
    copy = checkout_copy(tmp_path)
    procs = [import_from(copy) for _ in range(3)]
    results = [finish(p) for p in procs]
    assert all("LOADED True" in out for out, _ in results), results
    assert sum(err.count("capstan.native: building") for _, err in results) == 1, results


def test_build_can_be_turned_off(tmp_path):
    copy = checkout_copy(tmp_path)
    out, err = finish(import_from(copy, CAPSTAN_NATIVE_BUILD="0"))
    assert "LOADED False" in out and "building" not in err, out + err
    assert err.count("using the pure-torch fallback") == 1, err


def test_failed_build_is_one_warning_and_the_fallback(tmp_path):
    copy = checkout_copy(tmp_path)
    (copy / "csrc" / "api.cc").write_text("this is not C++\n")
    out, err = finish(import_from(copy))
    assert "LOADED False" in out, out + err
    assert err.count("using the pure-torch fallback") == 1, err
    assert f"building it from {copy} failed" in err, err


def test_this_checkout_runs_the_suite_with_its_library():
    # The suite must not pass by skipping every native test (CI once did).
    if "CAPSTAN_NATIVE_LIB" in os.environ or os.environ.get("CAPSTAN_NATIVE_BUILD") == "0":
        pytest.skip("requires_native: the library was pointed elsewhere or its build turned off")
    if _lib._builder() is None:
        pytest.skip("requires_native: installed from a wheel, not a checkout")
    assert native.status()["loaded"], native.status()
