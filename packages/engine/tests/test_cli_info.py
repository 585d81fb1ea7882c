"""`capstan info` reports the installation and the launch it detects."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from capstan.comm.testing import clean_env, mpirun_args, requires_mpirun


def _capstan() -> list[str]:
    exe = shutil.which("capstan")
    return [exe] if exe else [sys.executable, "-m", "capstan.engine.cli"]


def test_info_json_has_versions_native_and_launch() -> None:
    out = subprocess.run(_capstan() + ["info", "--json"], capture_output=True, text=True, timeout=120,
                         env=clean_env())
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    import torch

    assert info["torch"] == torch.__version__
    assert info["capstan"]["comm"] == "0.1.0"
    assert info["launcher"] == "single" and info["world size"] == "world size 1 from default"
    assert info["cuda available"] == torch.cuda.is_available()
    assert info["cuda"]["available"] == torch.cuda.is_available()  # GPUs, driver and free memory where there are
    if torch.cuda.is_available():
        assert info["cuda"]["devices"] >= 1 and "GiB free" in info["cuda"]["cuda:0"] and info["cuda"]["driver"]
    assert "native" in info and isinstance(info["native"], dict)


@requires_mpirun()
def test_info_under_mpirun_reports_the_mpi_world() -> None:
    cmd = mpirun_args(2) + _capstan() + ["info", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert out.returncode == 0, out.stderr
    infos = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(i["rank"] for i in infos) == ["rank 0 from OMPI_COMM_WORLD_RANK", "rank 1 from OMPI_COMM_WORLD_RANK"]
    assert {i["world size"] for i in infos} == {"world size 2 from OMPI_COMM_WORLD_SIZE"}
