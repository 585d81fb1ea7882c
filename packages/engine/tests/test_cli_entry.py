"""`cli.commands.entry`: the program entry leaves through os._exit with main's code (see its docstring for why).

Each case runs in a subprocess, since entry() ends the process: the exit code, and what reached
stdout/stderr (flushed before os._exit skips interpreter teardown).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = {
    "returns 0": ("lambda: (print('out'), 0)[1]", 0, "out", ""),
    "returns 2": ("lambda: 2", 2, "", ""),
    "SystemExit(None)": ("lambda: sys.exit()", 0, "", ""),
    "SystemExit(3)": ("lambda: sys.exit(3)", 3, "", ""),
    "SystemExit(text)": ("lambda: sys.exit('bad thing')", 1, "", "bad thing"),
    "uncaught error": ("lambda: 1 / 0", 1, "", "ZeroDivisionError"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_entry_exit_code_and_output(name: str) -> None:
    fake_main, want_code, want_out, want_err = CASES[name]
    script = (
        "import sys, logging\n"
        "import capstan.engine.cli.commands as cli\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "logging.getLogger('t').warning('logged line')\n"
        f"cli.main = {fake_main}\n"
        "cli.entry()\n"
        "print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == want_code, done.stderr
    assert "not reached" not in done.stdout
    assert want_out in done.stdout
    assert want_err in done.stderr
    assert "logged line" in done.stderr


def test_a_failing_rank_decides_its_grace_without_importing_torch() -> None:
    """`entry` waits ERROR_GRACE_S only under a multi-rank launch, and finds that out from the
    launcher's variables: importing capstan.comm for it imported torch, which took 2-4 s of every
    failing `capstan launch` (the launcher is no rank)."""
    script = ("import sys\nfrom capstan.engine.cli.commands import _multi_rank_launch\n"
              "print(_multi_rank_launch(), 'torch' in sys.modules)\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.split() == ["False", "False"], done.stderr
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**env, "OMPI_COMM_WORLD_SIZE": "2"})
    assert done.stdout.split() == ["True", "False"], done.stderr


def test_the_error_tables_name_real_error_classes() -> None:
    """The command line classifies an error by its defining module's table entry (commands._BAD_INPUT,
    _RUN_FAILURES: no import of torch-backed modules to ask); a class that moved would silently turn a
    bad-input line into a traceback, so each entry must name the class where it is defined."""
    import importlib

    from capstan.engine.cli import commands

    for module, name in commands._BAD_INPUT + commands._RUN_FAILURES:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Exception) and cls.__module__ == module, (module, name)
