"""How closely a result computed on the device under test may be compared with the CPU's.

Tests of the device path train the same model on the CPU and on "the device": the CPU itself (a
chunk tier standing in for a device with buffers in RAM), the stand-in accelerator whose memory
is host memory and whose ops run the CPU's kernels (a PrivateUse1 backend, capstan.native), or a
real GPU. The first two compute the CPU's own arithmetic, so the comparison stays exact (or
within the 1e-6 of reordered reductions). A GPU's kernels sum in other orders and round
differently, so against the CPU:

* fp32 is compared within `FP32_VS_CPU` (1e-4 relative, the bar of integration_tests/test_gpu.py)
  with TF32 off (`no_tf32`): TF32 rounds matmul inputs to 10 mantissa bits, ~1e-3 relative;
* bf16 as a trajectory within `BF16_VS_CPU` (2e-2 relative per step): measured on the CPU, a
  bf16 run of the chunkmem tests' nets stays within 8e-4 of the same run in fp32 over 10 steps
  (fp32 masters and an fp32 loss), so all of bf16's rounding moves the losses by under 0.1%; a
  GPU rounds the same bf16 values in another order, which moves them by no more than that. 2%
  leaves a 25x margin, while one wrong or skipped update (these nets' losses fall 5-15% per step
  early on) still fails.

Usage::

    tol = 1e-6 if cpu_arithmetic(device) else FP32_VS_CPU
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["cpu_arithmetic", "no_tf32", "FP32_VS_CPU", "BF16_VS_CPU"]

FP32_VS_CPU = 1e-4
BF16_VS_CPU = 2e-2


def cpu_arithmetic(device: str | torch.device | None) -> bool:
    """Whether `device` computes with the CPU's kernels: None or "cpu", or the PrivateUse1 backend
    (capstan's stand-in device, computing on host memory); False for CUDA and any other accelerator."""
    if device is None:
        return True
    kind = str(device).split(":")[0]
    # "standin": capstan.native.standin's name for PrivateUse1, known here before it is loaded
    # (comm does not import native)
    return kind in ("cpu", "standin", "privateuseone", torch._C._get_privateuse1_backend_name())


@contextmanager
def no_tf32(device: str | torch.device | None) -> Iterator[None]:
    """TF32 off for CUDA matmuls and cuDNN convolutions while fp32 results are compared with the
    CPU's (cuDNN allows it by default; a caller may have allowed it for matmuls); restored after.
    Nothing to do on any other device."""
    if device is None or str(device).split(":")[0] != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
