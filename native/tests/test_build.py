"""The library: status report, fallback when it cannot load, env overrides, CUDA compile."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import build_native  # native/, put on sys.path by conftest.py
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
    for key in ("library", "abi version", "isa", "isas compiled", "threads", "cuda built",
                "cuda loaded"):
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


@pytest.mark.skipif(build_native.find_nvcc() is None, reason="requires_nvcc: nvcc not found")
def test_cuda_library_compiles(tmp_path):
    # Compiles only; whether it runs needs a GPU (capstan.native.cuda loads it there).
    info = build_native.build_cuda(tmp_path)
    assert info["built"], info
    syms = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / "libcapstan_cuda.so")],
                          capture_output=True, text=True).stdout
    for name in ("capstan_cuda_host_alloc", "capstan_cuda_memcpy_async", "capstan_cuda_cast",
                 "capstan_cuda_event_record"):
        assert name in syms
