"""All-to-all with equal splits: what context parallelism's Ulysses attention exchanges.

    comm.all_to_all(output, tensor, group=groups.cp)

`tensor` and `output` are contiguous and hold `group.size` equal parts each, part i of `tensor` going to
rank i, whose part j of `output` comes from rank j (MPI_Alltoall, torch's all_to_all_single). An
identity copy on a group of one. Through MPI under mpirun, else torch.distributed (gloo on the CPU,
NCCL on GPUs), or staged through host memory where ranks share a GPU, as every collective here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..backends import mpi_backend
from ..job.groups import Group
from .collectives import _check, _group, _on_host, guard, staged

__all__ = ["all_to_all"]


def all_to_all(output: torch.Tensor, tensor: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """Rank i's part j of `tensor` becomes rank j's part i of `output` (equal parts, flat order)."""
    _check("output", output)
    _check("tensor", tensor)
    g = _group(group)
    if output.dtype != tensor.dtype or output.numel() != tensor.numel():
        raise ValueError(f"all_to_all needs output and tensor of one dtype and size, got {output.dtype} x "
                         f"{output.numel()} and {tensor.dtype} x {tensor.numel()}")
    if tensor.numel() % g.size:
        raise ValueError(f"all_to_all of {tensor.numel()} elements does not split into {g.size} equal parts")
    if (staged(tensor) or staged(output)) and g.size > 1:
        _on_host(lambda o, i: all_to_all(o, i, g), (output,), (tensor,))
        return output
    if g.size == 1 or tensor.numel() == 0:
        output.view(-1).copy_(tensor.view(-1))
        return output
    with guard("all_to_all", g, tensor.numel() * tensor.element_size()):
        if mpi_backend.supports(tensor, g):
            mpi_backend.all_to_all(output, tensor, g)
        else:
            dist.all_to_all_single(output.view(-1), tensor.view(-1), group=g.pg)
    return output
