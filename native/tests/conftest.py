"""Shared fixtures: the native capability report, forced ISA paths, seeded tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# native/build_native.py (the build logic, used by the CUDA compile test and the
# sanitizer test) is not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capstan import native
from capstan.native import _lib, kernels

STATUS = native.status()
requires_native = pytest.mark.skipif(
    not STATUS["loaded"], reason=f"requires_native: libcapstan not loaded ({STATUS.get('reason')})")


def usable_isas() -> list[str]:
    """ISAs compiled into the library and supported by this CPU (scalar always)."""
    lib = _lib.get()
    if lib is None:
        return []
    return [name for code, name in enumerate(_lib.ISA_NAMES) if lib.capstan_set_isa(code) == 0]


@pytest.fixture(autouse=True)
def _restore_isa():
    """Tests may force an ISA; put the dispatcher's choice back afterwards."""
    lib = _lib.get()
    before = lib.capstan_get_isa() if lib is not None else None
    yield
    if lib is not None:
        lib.capstan_set_isa(before)


@pytest.fixture(params=usable_isas() or ["none"])
def isa(request) -> str:
    if request.param == "none":
        pytest.skip(f"requires_native: libcapstan not loaded ({STATUS.get('reason')})")
    kernels.set_isa(request.param)
    return request.param


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
