"""The least RAM (and device memory) a `ChunkedModel` needs at once, checked when it is built: a mixin of
`ChunkedModel` (chunked.py), whose chunks, hooks and manager it reads.

Forward and backward pin every parameter chunk of the module they run, plus a gradient chunk while its
gradient lands (`_hooks_need`); the optimizer pins one sibling group of every kind (`_optimizer_need`).
A budget below the larger of the two cannot train and is refused at once with the numbers, not at the
first step. The sharded and replicated models override the needs (parallel/).
"""

from __future__ import annotations

from ..memory.tiers import BudgetError
from .states import ChunkKind

__all__ = ["MinimumBudget"]


class MinimumBudget:
    """The minimum-budget checks of `ChunkedModel` (the module docstring)."""

    def minimum_budget(self) -> tuple[int, str]:
        """Bytes of chunks that must fit in RAM at once, and what needs them (known before training).

        The larger of what forward/backward holds at once (`_hooks_need`) and what the optimizer
        holds (one sibling group of every kind). (A step streamed during backward past RAM steps a
        group there only where it fits beside what backward holds, else after backward: overlap.py.)
        """
        need, what = self._hooks_need()
        opt_need, opt_what = self._optimizer_need()
        return (opt_need, opt_what) if opt_need > need else (need, what)

    def _optimizer_need(self) -> tuple[int, str]:
        """The optimizer holds one sibling group of every kind in RAM at once."""
        need, what = 0, "nothing"
        for g in range(len(self.chunks[ChunkKind.PARAM])):
            for i in self.owned_indices(g):
                total = sum(self.chunks[k][g][i].nbytes for k in self.kinds())
                if total > need:
                    need, what = total, "one optimizer step over a chunk group"
        return need, what

    def _hooks_need(self) -> tuple[int, str]:
        """Forward/backward: every parameter chunk one module pins, plus a gradient chunk while its
        gradient lands."""
        need, what = 0, "nothing"
        grad_bytes = max((c.nbytes for lst in self.chunks.get(ChunkKind.GRAD, []) for c in lst), default=0)
        hooked = {id(m) for m in self.hooked_modules()}
        for name, module in self.module.named_modules():
            homes = self.module_homes(module) if id(module) in hooked else []
            chunks = {id(c): c for c in (self.chunk_of(h, ChunkKind.PARAM) for h in homes)}
            total = sum(c.nbytes for c in chunks.values()) + (grad_bytes if homes else 0)
            if total > need:
                need, what = total, f"module {name or type(module).__name__}"
        return need, what

    # `_budget_need` is the least budget that works; the sharded model's is a bound that always suffices.
    budget_need_exact = True

    def _group_need(self, need: int, what: str) -> tuple[int, str]:
        """A need as every rank of the shard group sees it (the sharded model takes the largest), so all
        of them accept or refuse a budget alike."""
        return need, what

    def _budget_need(self) -> tuple[int, str]:
        """The minimum budget checked at construction (the sharded model takes the largest over its group)."""
        return self.minimum_budget()

    def _check_budget(self) -> None:
        dev = self.manager.dev
        if dev is not None and dev.capacity is not None:  # forward/backward compute on the device
            need, what = self._group_need(*self._hooks_need())
            if dev.capacity < need and self.manager.device_tier.device_limit is not None:
                self.manager.device_tier.raise_warmup(need)  # a budget derived from the device: give the warm-up more
            if dev.capacity < need:
                raise BudgetError(
                    f"{dev.name} budget of {dev.capacity} bytes is below the working set: {what} needs {need} "
                    f"bytes of chunks on the device at once; the minimum device budget for this model and chunk "
                    f"size is {need} bytes (plus its activations)")
        capacity = self.manager.cpu.capacity
        if capacity is None:
            return
        need, what = self._budget_need() if dev is None else self._group_need(*self._optimizer_need())
        staging = self.manager.device_tier.staging_bytes()  # a device's copies through pinned buffers (transfer.py)
        if staging:
            need, what = need + staging, f"{what} and the {staging} bytes of pinned staging buffers"
        if capacity >= need:
            return
        if self.budget_need_exact:
            raise BudgetError(
                f"cpu budget of {capacity} bytes is below the working set: {what} needs {need} bytes of "
                f"chunks in RAM at once; the minimum budget for this model and chunk size is {need} bytes "
                f"(plus its activations)")
        raise BudgetError(
            f"cpu budget of {capacity} bytes is below what {what} may need at once: {need} bytes of chunks "
            f"and gather/reduce buffers in the worst case, the budget this model and chunk size need to be "
            f"sure to fit (plus its activations)")
