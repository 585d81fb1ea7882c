"""tools/gpu/battery.sh's setup, checked on the CPU before a GPU machine ever runs it.

A GPU is at hand rarely and for half an hour: the script must not lose that time to a missing test
plugin. A bare GPU machine may lack pytest-timeout and hypothesis; here both are made unimportable
(a directory first on PYTHONPATH whose modules of those names raise ModuleNotFoundError, as a
missing module does, and pytest's `-p no:` for their plugins), and the script's setup and the
collection it runs must go through.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu" / "battery.sh"


def _blocker(tmp_path: Path) -> Path:
    """A PYTHONPATH entry under which `import pytest_timeout` and `import hypothesis` fail."""
    d = tmp_path / "blocked"
    (d / "hypothesis").mkdir(parents=True)
    for name, f in (("pytest_timeout", d / "pytest_timeout.py"), ("hypothesis", d / "hypothesis" / "__init__.py")):
        f.write_text(f'raise ModuleNotFoundError("No module named {name!r} (a simulated bare machine)", '
                     f'name={name!r})\n')
    return d


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env.update(extra)
    return env


def test_the_script_parses() -> None:
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_setup_goes_through_without_the_test_plugins(tmp_path: Path) -> None:
    """In a checkout with an empty .whl/ and neither plugin importable, the setup says what is
    missing and runs pytest under the step's cap alone, without --timeout, and a module that
    fails to import does not stop the run; with them, pytest gets its per-test timeout."""
    repo = tmp_path / "repo"
    (repo / "tools" / "gpu").mkdir(parents=True)
    (repo / ".whl").mkdir()  # carried, but empty
    shutil.copy(SCRIPT, repo / "tools" / "gpu" / SCRIPT.name)
    cmd = ["bash", str(repo / "tools" / "gpu" / SCRIPT.name), "--dry-run"]
    bare = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=_env(PYTHON=sys.executable, OUT=str(tmp_path / "out"),
                                   PYTHONPATH=str(_blocker(tmp_path))))
    assert bare.returncode == 0, bare.stdout + bare.stderr
    text = bare.stdout
    assert "pytest-timeout is not installed" in text and "hypothesis is not installed" in text, text
    test_line = next(line for line in text.splitlines() if line.startswith("would tests:"))
    assert "--continue-on-collection-errors" in test_line and "-m cuda" in test_line
    assert "--timeout" not in test_line and test_line.startswith("would tests: timeout -k"), test_line
    assert "would install" not in text  # an empty .whl/ installs nothing

    full = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=_env(PYTHON=sys.executable, OUT=str(tmp_path / "out")))
    assert full.returncode == 0, full.stdout + full.stderr
    test_line = next(line for line in full.stdout.splitlines() if line.startswith("would tests:"))
    assert "--timeout 120" in test_line and "not installed" not in full.stdout, full.stdout


def test_collection_survives_without_pytest_timeout_and_hypothesis(tmp_path: Path) -> None:
    """The modules that need either plugin: one carries @pytest.mark.timeout (an unknown mark is a
    collection error under --strict-markers unless registered), one imports hypothesis."""
    modules = ["packages/comm/tests/test_topology.py", "integration_tests/test_layout_matrix.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:timeout", "-p", "no:hypothesispytest",
                          "-p", "no:cacheprovider", "-m", "cuda", "--collect-only", "-q", "-rs", *modules],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=_env(PYTHONPATH=str(_blocker(tmp_path))))
    report = out.stdout + out.stderr
    assert out.returncode in (0, 5), report  # 5: nothing selected by -m cuda, and no error
    assert "error" not in report.lower(), report
