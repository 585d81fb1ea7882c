"""Tests parametrized with device "standin" run on the CPU suite's stand-in accelerator
(capstan.native.standin), loaded into this process the first time one needs it."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _standin(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("device") == "standin":
        from capstan.native import standin

        standin.load()
    yield
