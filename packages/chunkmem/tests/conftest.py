"""Tests parametrized with device "standin" run on the CPU suite's stand-in accelerator
(capstan.native.standin). It is loaded once collection is done and before any test runs: autograd
sizes its per-device queues at the first backward of a process, so a device registered after that
one cannot run a backward. (The stand-in then stays loaded for the rest of this pytest process.)"""

from __future__ import annotations


def _wants_standin(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("device") == "standin"


def pytest_collection_modifyitems(session, config, items) -> None:
    if any(_wants_standin(item) for item in items):
        from capstan.native import standin

        if standin.available():
            standin.load()
