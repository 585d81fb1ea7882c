"""The library: status report, fallback when it cannot load, env overrides, no CUDA library."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import build_native  # native/, put on sys.path by conftest.py
import pytest

from capstan import native
from capstan.native import _lib

requires_native = pytest.mark.skipif(
    not native.status()["loaded"],
    reason=f"requires_native: libcapstan not loaded ({native.status().get('reason')})")


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@requires_native
def test_status_shape():
    st = native.status()
    for key in ("library", "abi version", "isa", "isas compiled", "threads"):
        assert key in st, key
    assert st["abi version"] == _lib.ABI_VERSION
    assert "scalar" in st["isas compiled"]


def test_missing_library_falls_back_with_one_warning():
    proc = run_py("""
        import torch
        from capstan.native import kernels, fallback, status
        p, g, m, v = torch.randn(100), torch.randn(100), torch.zeros(100), torch.zeros(100)
        q = p.clone()
        kernels.adam_update(p, g, m, v, step=1)
        kernels.adam_update(p, g, m, v, step=2)
        fallback.adam_step(q, g, torch.zeros(100), torch.zeros(100), step=1, lr=1e-3,
                           beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
        print("STATUS", status()["loaded"], status()["using"])
    """, CAPSTAN_NATIVE_LIB="/nonexistent/libcapstan.so")
    assert proc.returncode == 0, proc.stderr
    assert "STATUS False pure-torch fallback" in proc.stdout
    assert proc.stderr.count("using the pure-torch fallback") == 1, proc.stderr


@requires_native
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_isa_env_override(isa):
    if isa not in native.status()["isas compiled"]:
        pytest.skip(f"requires_native: {isa} not compiled for this machine")
    proc = run_py("from capstan.native import kernels; print('ISA', kernels.get_isa())",
                  CAPSTAN_NATIVE_ISA=isa, CAPSTAN_NATIVE_THREADS="3")
    assert f"ISA {isa}" in proc.stdout, proc.stderr


@requires_native
def test_bad_isa_env_warns_and_uses_best():
    proc = run_py("from capstan.native import kernels; print('ISA', kernels.get_isa())",
                  CAPSTAN_NATIVE_ISA="sse9")
    assert "CAPSTAN_NATIVE_ISA='sse9' is not usable" in proc.stderr
    assert "ISA " in proc.stdout


def test_no_cuda_library_is_built_or_shipped(tmp_path):
    """libcapstan_cuda was removed (docs/native.md: torch's caching host allocator and streams do
    what it did): no source, no binding, no build step, and a copy left by an older build is
    deleted so a wheel cannot ship it."""
    import importlib.util

    assert not (Path(build_native.__file__).parent / "cuda").exists() and not hasattr(build_native, "build_cuda")
    assert importlib.util.find_spec("capstan.native.cuda") is None
    out = tmp_path / "lib"
    out.mkdir()
    (out / "libcapstan_cuda.so").write_bytes(b"stale")
    real = build_native.build_cpu
    build_native.build_cpu = lambda out_dir, **kw: out_dir / "libcapstan.so"  # no compile: only the record
    try:
        info = build_native.build_all(out)
    finally:
        build_native.build_cpu = real
    assert "cuda" not in info and not (out / "libcapstan_cuda.so").exists()


def test_a_sanitizer_build_compiles_only_the_isas_this_cpu_runs(monkeypatch, tmp_path):
    """A release build compiles every x86-64 ISA unit (the dispatcher picks one at run time); a
    sanitizer build, which exists to run the tests here, only those the host's CPU flags allow."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse2 avx avx2 fma f16c bmi2\n")
    monkeypatch.setattr(build_native, "target_arch", lambda target=None: "x86_64")
    assert build_native.isa_units() == ["avx2", "avx512", "avx512bf16"]
    assert build_native.isa_units(sanitize=True, cpuinfo=cpuinfo) == ["avx2"]
    cpuinfo.write_text("flags : avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16\n")
    assert build_native.isa_units(sanitize=True, cpuinfo=cpuinfo) == ["avx2", "avx512", "avx512bf16"]
    monkeypatch.setattr(build_native, "target_arch", lambda target=None: "aarch64")
    assert build_native.isa_units(sanitize=True, cpuinfo=cpuinfo) == [] and build_native.isa_units() == []
