"""For every package's tests (the suite runs them in one pytest process): tests parametrized with device
"standin" run on the CPU suite's stand-in accelerator
(capstan.native.standin). It is loaded once collection is done and before any test runs: autograd
sizes its per-device queues at the first backward of a process, so a device registered after that
one cannot run a backward. (The stand-in then stays loaded for the rest of this pytest process.)
Only when such a test is still selected (`-m cuda` on a GPU machine selects none), and a stand-in
that cannot be built here skips its tests with the reason rather than stopping the run."""

from __future__ import annotations

import os

import pytest

# Multi-rank tests fork their ranks from a process that imported torch once (docs/testing.md, "Ranks
# forked from a server"); CAPSTAN_TEST_FORKSERVER=0 in the environment starts fresh interpreters.
os.environ.setdefault("CAPSTAN_TEST_FORKSERVER", "1")

from capstan.comm.testing import no_tf32


def _wants_standin(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("device") == "standin"


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(session, config, items) -> None:
    wanted = [item for item in items if _wants_standin(item)]
    if not wanted:
        return
    from capstan.native import standin

    try:
        standin.load()
    except Exception as exc:  # a build failure names itself on each test instead of ending collection
        for item in wanted:
            item.add_marker(pytest.mark.skip(reason=f"the stand-in device could not be loaded: {exc}"))


@pytest.fixture(autouse=True)
def _no_tf32_on_cuda(request: pytest.FixtureRequest):
    """TF32 off while a test parametrized with device="cuda" runs: fp32 is compared with the CPU."""
    callspec = getattr(request.node, "callspec", None)
    with no_tf32(callspec.params.get("device") if callspec else None):
        yield
