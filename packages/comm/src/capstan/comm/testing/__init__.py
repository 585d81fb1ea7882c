"""capstan.comm.testing: run a test function on N real processes.

`run_ranks(fn, n)` starts n processes with a file rendezvous (no fixed
ports, so tests can run concurrently), each calling ``fn(*args)`` after
`capstan.comm.init()`, and returns the n results in rank order. The ranks are
fresh interpreters, or with CAPSTAN_TEST_FORKSERVER=1 (as the suite runs)
forked from a process that has imported torch once (forkserver.py).
`run_mpirun(fn, n)` does the same under a real ``mpirun``. Either one fails
the test, with every rank's traceback and output tail in the message, when a
rank raises or exits non-zero, and kills everything at `timeout` instead of
hanging. `fn` must be a module-level function; its arguments and result must
pickle. `cpu_arithmetic(device)` and `no_tf32(device)` (devices.py) set how
closely a device's results are compared with the CPU's.

Example::

    def _sum(x):
        from capstan import comm
        t = torch.full((3,), float(x + comm.world().rank))
        return comm.all_reduce(t).tolist()

    def test_sum():
        assert run_ranks(_sum, 2, 1) == [[3.0] * 3] * 2
"""

from .devices import BF16_VS_CPU, FP32_VS_CPU, cpu_arithmetic, no_tf32
from .harness import (
    RankFailure,
    bytes_written,
    clean_env,
    cuda_marks,
    cuda_param,
    find_mpirun,
    mpirun_args,
    mpirun_flavor,
    requires_cuda,
    requires_mpirun,
    run_mpirun,
    run_ranks,
)

__all__ = ["BF16_VS_CPU", "FP32_VS_CPU", "RankFailure", "bytes_written", "clean_env", "cpu_arithmetic",
           "cuda_marks", "cuda_param", "find_mpirun", "mpirun_args", "mpirun_flavor", "no_tf32", "requires_cuda",
           "requires_mpirun", "run_mpirun", "run_ranks"]
