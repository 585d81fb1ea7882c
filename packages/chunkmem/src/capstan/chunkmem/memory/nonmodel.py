"""Non-model memory: what RAM the chunks may use at each moment, given the activations beside them.

PatrickStar's observation: the memory a training step needs besides the model
states (activations, temporary buffers) varies over the step — it grows
during forward and shrinks during backward — so the memory left for chunks
("chunkable memory") varies too. With a total `memory_limit`:

* warm-up step: chunks stay within the (conservative) cpu budget while the
  manager samples the non-model memory at every moment, as RSS beyond the
  chunk system's own bytes and beyond the RSS when the manager was created
  (Linux `/proc/self/statm`), together with the bytes of chunks in use at
  that moment. So that RSS follows the activations, the manager fixes glibc's
  mmap threshold (`return_freed_memory`): large tensors are then mmap-backed
  and their pages leave RSS when they are freed;
* `check_memory_limit` at its end: the limit must cover, at every moment,
  the chunks in use plus the non-model memory there, else a `BudgetError`
  naming the busiest moment and the minimum limit;
* later steps: at moment m the chunks' capacity is the limit minus
  `nonmodel_ahead(m)`, the larger of the non-model memory measured at m and
  at m + 1 (activations created between two chunk accesses are there by the
  next one); the manager evicts down to it when the capacity shrinks.
  Accesses beyond the warm-up trace (an eval pass, a longer step) get the
  step's peak non-model memory: the conservative choice.

The chunk bytes are exact (counted by the manager); the non-model part is a
measurement, so the total is as good as RSS sampling at chunk accesses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from .tiers import BudgetError

__all__ = ["nonmodel_ahead", "check_memory_limit", "return_freed_memory", "trim_heap"]

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, looked up once (`find_library` may start a subprocess); None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc's, not another libc's
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def return_freed_memory(threshold: int = 1 << 17) -> bool:
    """Make glibc serve allocations >= `threshold` bytes with mmap and unmap them when freed.

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which
    large tensors come from the heap and their pages stay in RSS when freed, so RSS would stop
    following the activations. Fixing the threshold (which also turns that adjustment off) keeps
    RSS a measurement of live memory; `malloc_trim` returns the pages of free heap blocks, which
    later allocations may reuse. Returns False where there is no glibc.
    """
    libc = _libc()
    if libc is None:
        return False
    done = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    # Free heap memory left by earlier work would be reused without growing RSS: give its
    # pages back (malloc_trim also releases free pages inside the heap), so reusing them
    # faults them in again and shows in RSS.
    trim_heap()
    return done


def trim_heap() -> bool:
    """Give the pages of free heap blocks back to the OS (glibc `malloc_trim`); False without glibc.

    For work that frees large tensors it will not allocate again soon (building a model layer by
    layer into chunks): glibc keeps such freed blocks in RSS once its mmap threshold has risen."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def nonmodel_ahead(nonmodel: list[int], moment: int) -> int:
    """Non-model bytes to leave free at `moment` (the step's peak beyond the warm-up trace)."""
    if not nonmodel:
        return 0
    if moment + 1 >= len(nonmodel):
        return max(nonmodel)
    return max(nonmodel[moment], nonmodel[moment + 1])


def check_memory_limit(limit: int, pinned: list[int], nonmodel: list[int], what: str = "memory limit") -> None:
    """Raise if chunks in use plus non-model memory exceeded `limit` at some warm-up moment."""
    need = [p + nonmodel_ahead(nonmodel, m) for m, p in enumerate(pinned)]
    if not need:
        return
    worst = max(range(len(need)), key=need.__getitem__)
    if need[worst] > limit:
        raise BudgetError(
            f"{what} of {limit} bytes is below what the warm-up step needed at its busiest moment "
            f"({worst}): {pinned[worst]} bytes of chunks in use plus {need[worst] - pinned[worst]} bytes of "
            f"non-model memory (activations); the minimum limit is {need[worst]} bytes")
