"""`first_error`: every rank learns the first failing rank's error, so all raise together.

An error found on one rank only (a full disk under a checkpoint shard, a run
directory another job holds, a corrupt file) must not leave the other ranks
waiting in their next collective until the comm timeout, and must not give
each rank a different story. Each rank passes its own error text ("" when it
has none) into one all-gather; all get back the text of the lowest failing
rank, named when it is another rank's.
"""

from __future__ import annotations

import torch

from ..job.groups import Group
from .collectives import all_gather

__all__ = ["first_error"]

WIDTH = 1024  # bytes of each rank's message that travel (the rest is cut off)


def first_error(error: str, group: Group) -> str:
    """The lowest-ranked non-empty error of `group` ("rank R: ..." when it is not this rank's), or ""."""
    if group.size == 1:
        return error
    mine = torch.zeros(WIDTH, dtype=torch.uint8)
    raw = error.encode()[:WIDTH]
    if raw:
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    every = torch.zeros(WIDTH * group.size, dtype=torch.uint8)
    all_gather(every, mine, group=group)
    for r in range(group.size):
        text = bytes(every[r * WIDTH : (r + 1) * WIDTH].tolist()).rstrip(b"\0").decode(errors="replace")
        if text:
            return text if r == group.rank else f"rank {r}: {text}"
    return ""
