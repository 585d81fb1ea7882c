"""The process a multi-rank test runs in: `python -m capstan.comm.testing.worker SPEC`.

It loads the test function named in SPEC (a pickle written by the harness),
initializes capstan.comm from the launcher's variables (the harness's file
rendezvous, or mpirun's), calls the function, and leaves either a pickled
result or a traceback in the run directory for the harness to report.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

IMPORTING_TARGET = "CAPSTAN_RANK_IMPORTING"  # set while a rank imports the file of its target function


def load_function(module: str, path: str, qualname: str) -> Any:
    """Find the function by module name (installed packages) or by file path (test files)."""
    if module.startswith("capstan.") or not path:
        obj: Any = importlib.import_module(module)
    else:
        name = f"_capstan_target_{abs(hash(path))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load test module from {path}")
        obj = importlib.util.module_from_spec(spec)
        sys.modules[name] = obj
        # A script that calls run_ranks at module level (no ``if __name__ == "__main__":``) would
        # start ranks again from every rank, each of which imports it again: run_ranks refuses then.
        os.environ[IMPORTING_TARGET] = path
        try:
            spec.loader.exec_module(obj)
        finally:
            del os.environ[IMPORTING_TARGET]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(spec_path: str) -> int:
    spec = pickle.loads(Path(spec_path).read_bytes())
    run_dir = Path(spec["run_dir"])
    import torch

    torch.set_num_threads(int(os.environ.get("CAPSTAN_TEST_THREADS", "1")))
    from capstan import comm
    from capstan.comm.job.launch_env import env_rank

    rank = -1
    try:
        if spec["init"]:
            world = comm.init(backend=spec["backend"], timeout=spec["comm_timeout"])
            rank = world.rank
        else:
            rank = comm.detect_launch().rank
        fn = load_function(spec["module"], spec["path"], spec["qualname"])
        result = fn(*spec["args"], **spec["kwargs"])
        tmp = run_dir / f".result.{rank}.tmp"
        tmp.write_bytes(pickle.dumps(result))
        os.replace(tmp, run_dir / f"result.{rank}.pkl")
        code = 0
    except BaseException:  # noqa: BLE001 - every failure must reach the report
        if rank < 0:
            rank = env_rank() or 0
        (run_dir / f"error.{rank}.txt").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and spec["init"]:
        comm.shutdown()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        if code == 0:
            mpi.Finalize()  # mpirun treats an exit without finalize as a crash
        else:
            mpi.COMM_WORLD.Abort(code)  # peers may be blocked in MPI: end the whole job now
    # Skip interpreter teardown: a failed rank must not wait on peers in atexit hooks.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
