"""The linter runs in the suite: ruff over the whole repository, with the configuration in pyproject.toml
([tool.ruff]; docs/testing.md, "Lint"). Fix locally with `hatch run ruff check --fix .`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_the_code_passes_ruff() -> None:
    # ruff is a declared test dependency (pyproject.toml, [tool.hatch.envs.default]): missing is a failure, not a skip
    if importlib.util.find_spec("ruff") is None:
        pytest.fail(f"ruff is not installed for {sys.executable}: it is a test dependency "
                    "(pyproject.toml [tool.hatch.envs.default] dependencies); `hatch env remove default` and "
                    "`hatch run test` reinstall the environment with it")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-fix", "--output-format", "concise", str(ROOT)],
                         cwd=ROOT, capture_output=True, text=True, timeout=100)
    if out.returncode != 0:
        pytest.fail(f"ruff check (exit status {out.returncode}); fix with `hatch run ruff check --fix .`, and by "
                    f"hand what --fix cannot:\n{out.stdout}{out.stderr}", pytrace=False)
