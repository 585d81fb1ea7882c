"""ZeRO-3 through chunks: each data-parallel rank owns 1/N of the chunks.

Chunks of a list form *communication groups* of N consecutive chunks (the
list is padded to a multiple of N); rank r owns chunk r of every group and
keeps parameters, gradients and Adam moments only for owned chunks (the
manager places those between RAM and disk as usual). The other chunks'
parameters are transient:

* normal mode: the first access to any chunk of a group all-gathers the
  whole group into one buffer (every rank contributes its owned chunk); an
  unpinned buffer stays for reuse until the end of backward with RAM
  unbounded, or while it fits in the budget's headroom (`_kept_bytes`), and
  is dropped least recently used first otherwise. Gradients of a group go into a group-sized buffer
  that is reduce-scattered (averaged) to the owners once every parameter of
  the group has its gradient (or at the end of backward). At most one such
  buffer per parameter group is open: a gradient that opens one more (they
  arrive out of layout order: tied weights, a model built in another order
  than it runs) first flushes the longest idle buffer, partly filled (the
  owner's GRAD chunk adds the rest later).
* memory-saving mode: the same per chunk instead of per group, by broadcast
  from the owner and reduce to the owner, so only one remote chunk (and one
  gradient chunk) is resident at a time, for N times the collectives.
* ``quantized`` (the engine's ``parallel.compression = "int8"``, ZeRO++'s
  qwZ and qgZ): the normal mode's unit all-gathers and gradient
  reduce-scatters travel as int8 blocks with a scale each
  (`comm.quantized_all_gather` / `comm.quantized_reduce_scatter`, summed in
  fp32); an owner keeps its chunk exact and computes with it, the others
  with its dequantized copy. Chunk lists never mix tp-sliced and replicated
  parameters, so tp ranks quantize replicated chunks alike. The
  memory-saving mode's broadcasts and reduces are not compressed.

Every collective is triggered by the access sequence alone, which is the
same on every rank, so all ranks call them in the same order. Transient
buffers are reserved in the cpu tier before they exist: the budget stays exact,
and `minimum_budget()` is a safe bound of what the code above holds at once
(`_hooks_need`): the units of every parameter group one module (with its
ancestors, tied and frozen parameters) touches, the open gradient buffers and
a flush's chunks.

With RAM unbounded the unit and gradient buffers are kept for reuse when
dropped (still counted as transient bytes): at dp = 2 they are 2 chunks
(33.5 MB for 4M-element chunks), above glibc's largest mmap threshold
(32 MiB), so each fresh one was a new mapping whose pages all faulted and
were zeroed on first touch: 80 ms of a 1.8 s step of a 27M-parameter GPT
went to `torch.zeros` alone. Under a budget they are freed as before, so the
headroom goes to chunks. A gradient buffer is not cleared when taken: each
slot's first gradient is copied in (later ones add), and `_flush` zeroes
only the slots no gradient wrote (padding, unused parameters) before the
reduction, which saves a clearing pass and the add's read of zeros.
"""

from __future__ import annotations

import torch
from torch import nn

from capstan import comm
from capstan.comm import Group
from capstan.comm.health import faults

from ..memory.manager import ChunkManager
from ..model.chunk import Chunk
from ..model.chunked import ChunkedModel, ParamHome
from ..model.states import ChunkKind, TensorState

__all__ = ["ShardedChunkedModel"]


class ShardedChunkedModel(ChunkedModel):
    """A `ChunkedModel` whose chunks are sharded over the data-parallel group `group`."""

    _gathers = True

    def __init__(self, module: nn.Module, manager: ChunkManager, chunk_size: int | None, group: Group,
                 memory_saving: bool = False, quantized: bool = False, **kwargs: object) -> None:
        # With a device tier the gathered units, the gradient buffers and the reductions live on the
        # device (counted in its tier), where the hooks compute; optimizer chunks stay in RAM.
        self._on_dev = manager.dev is not None
        self._buf_device = manager.device if manager.device is not None else torch.device("cpu")
        self.group = group
        self.memory_saving = memory_saving
        self.quantized = quantized  # int8 unit gathers and gradient reduce-scatters (module docstring)
        self._span = 1 if memory_saving else group.size  # chunks per transient unit
        self._gathered: dict[tuple[int, int], torch.Tensor] = {}  # (param group, unit) -> buffer
        self.unit_gathers = 0  # units materialized so far (all-gathers, or broadcasts in memory-saving mode)
        self._spare_bytes = 0  # bytes of unpinned units that may stay gathered under a budget (`_kept_bytes`)
        self._grad_bufs: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_slots: dict[tuple[int, int], dict[int, int]] = {}  # open buffer -> {slot start: end} written
        self._spares: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}  # RAM unbounded: buffers to reuse
        self._grad_missing: dict[tuple[int, int], int] = {}
        self._grad_expected: dict[tuple[int, int], int] = {}
        self._current: tuple[int, int] | None = None
        self._widths: dict[tuple[int, int], int] = {}  # (param group, unit) -> elements moved per chunk
        self.collective_elements = 0  # elements this rank sent into unit gathers and gradient reductions
        self._open_cap = 1  # reduction buffers open at once (`_grad_cap`, set with the counts)
        super().__init__(module, manager, chunk_size, **kwargs)  # type: ignore[arg-type]
        self._reset_grad_counts()

    # ---- ownership ------------------------------------------------------------------------------
    def _needs_grad_chunks(self) -> bool:
        return True  # reduce-scattered gradients land in the owners' fp32 GRAD chunks

    def _grad_dtype(self) -> torch.dtype:
        return torch.float32  # the fp32 reduction buffers' average, a bf16 master's too (an owned shard: 1/dp)

    def owner(self, index: int) -> int:
        return index % self.group.size

    def owned(self, index: int) -> bool:
        return self.owner(index) == self.group.rank

    def owned_indices(self, g: int) -> list[int]:
        return [i for i in range(len(self.chunks[ChunkKind.PARAM][g])) if self.owned(i)]

    def _reduction_groups(self) -> list[Group]:
        return [self.group, *super()._reduction_groups()]

    def _hooks_need(self) -> tuple[int, str]:
        """Forward/backward working set on this rank, counted from what the code holds at once.

        Gathered units: `_gather` keeps every unit with a pinned parameter and drops the others only
        when it gathers a new one, so at most the units of one module's parameters are held, plus
        those of parameters pinned around it: its hooked ancestors' (pinned through its forward and,
        for parameters used late, its backward), tied parameters' (pinned from their last use's
        backward to their gradient) and frozen ones' (pinned from backward to `finish_backward`).
        A module's parameters in several parameter groups sit in one unit per group. Besides the
        units' buffers (span times the unit's `_width` each), this rank's own chunks among those
        pinned stay resident.

        Gradients: at most one reduction buffer per parameter group with gradients is open
        (`grad_arrived` flushes the oldest early otherwise). A flush adds the reduce-scatter's
        output (one chunk, normal mode) and the owner's GRAD chunk it is added into; a gather adds
        this rank's own chunk of the new unit (the all-gather's source) instead.
        """
        if not self.homes:
            return 0, "nothing"
        elem = self.dtype.itemsize
        widest = {g: max(self._width(g, u) for u in range(len(lst) // self._span))
                  for g, lst in enumerate(self.chunks[ChunkKind.PARAM]) if lst}
        with_grads = {h.group for h in self.homes.values() if h.param.requires_grad}
        open_grads = sum(self._span * widest[g] * 4 for g in with_grads)  # one buffer per group
        flush = (0 if self.memory_saving else max(widest.values()) * 4) + self._largest_capacity() * 4
        users: dict[int, int] = {}
        hooked = [m for m in self.hooked_modules() if self.module_homes(m)]
        for m in hooked:
            for h in {id(h): h for h in self.module_homes(m)}.values():
                users[id(h)] = users.get(id(h), 0) + 1
        sticky = [h for h in self.homes.values() if users.get(id(h), 0) > 1 or not h.param.requires_grad]
        parent: dict[int, nn.Module] = {id(c): m for m in self.module.modules() for c in m.children()}
        hooked_ids = {id(m) for m in hooked}
        names = {id(m): n for n, m in self.module.named_modules()}
        need, what = 0, "nothing"
        for m in hooked:
            pinned = self.module_homes(m) + sticky
            up = parent.get(id(m))
            while up is not None:
                if id(up) in hooked_ids:
                    pinned += self.module_homes(up)
                up = parent.get(id(up))
            units = {self._key(h) for h in pinned}
            own = sum({(h.group, h.index): self._capacity(h.group) for h in pinned if self.owned(h.index)}.values())
            held = sum(self._span * self._width(*u) for u in units) * elem + open_grads
            gather = own + max((self._capacity(g) for g, _ in units), default=0)  # the new unit's own chunk
            total = held + max(own * elem + flush, gather * elem)
            if total > need:
                need, what = total, (f"module {names.get(id(m)) or type(m).__name__} ({len(units)} gathered "
                                     f"unit(s) of {self._span} chunk(s) at once) with its gradient reduction")
        return need, what

    def _capacity(self, g: int) -> int:
        """Elements per chunk of parameter group `g`'s list (`layout.list_capacity`)."""
        return self.chunks[ChunkKind.PARAM][g][0].capacity

    def _largest_capacity(self) -> int:
        return max((lst[0].capacity for lst in self.chunks[ChunkKind.PARAM] if lst), default=self.chunk_size)

    def _key(self, home: ParamHome) -> tuple[int, int]:
        return (home.group, self._unit(home.index))

    def _grad_cap(self) -> int:
        """Reduction buffers open at once: one per parameter group that has gradients."""
        return max(1, len({h.group for h in self.homes.values() if h.param.requires_grad}))

    def _padded_count(self, n: int) -> int:
        return -(-n // self.group.size) * self.group.size

    def _unit(self, index: int) -> int:
        return index // self._span

    def _width(self, g: int, unit: int) -> int:
        """Elements per chunk a unit's collectives move: the longest used prefix of its chunks.

        What follows in every chunk is padding nobody reads, and it can be most of a unit: a
        parameter group of a few norms' weights fills one chunk of many and is padded with
        another (`_padded_count`). Gathered chunks sit `width` apart in the unit's buffer and the
        gradient buffer has the same layout, so neither the all-gather, the reduction nor the
        clearing of unwritten slots touches padding. The layout is the same on every rank."""
        key = (g, unit)
        if key not in self._widths:
            chunks = self.chunks[ChunkKind.PARAM][g]
            self._widths[key] = max(1, max(chunks[i].used for i in self._unit_indices(g, unit)))
        return self._widths[key]

    # ---- transient buffers ----------------------------------------------------------------------
    def _tier(self) -> object:
        """The tier transient buffers live in: the device's where there is one, else RAM."""
        return self.manager.dev if self._on_dev else self.manager.cpu

    def _take_buffer(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """An uninitialized transient buffer, reserved in its tier: a kept one of the same shape if any."""
        spares = self._spares.get((numel, dtype))
        if spares:
            return spares.pop()  # still reserved since it was first made
        self.manager.reserve_transient(numel * dtype.itemsize, what, self._on_dev)
        return torch.empty(numel, dtype=dtype, device=self._buf_device)

    def _give_buffer(self, buf: torch.Tensor) -> None:
        """Done with a `_take_buffer` buffer: keep it (its tier unbounded) or free it and its reservation."""
        if self._tier().capacity is None:  # no budget (a ram_limit always sets one)
            self._spares.setdefault((buf.numel(), buf.dtype), []).append(buf)
        else:
            self.manager.release_transient(buf.numel() * buf.element_size(), self._on_dev)

    def _place(self, g: int, index: int, init: torch.Tensor) -> None:
        if self.owned(index):
            super()._place(g, index, init)

    # ---- transient units of remote chunks -------------------------------------------------------
    def _unit_indices(self, g: int, unit: int) -> range:
        return range(unit * self._span, (unit + 1) * self._span)

    budget_need_exact = False  # assumes the busiest module, every open gradient buffer and a flush coincide

    def _budget_need(self) -> tuple[int, str]:
        """The largest minimum over the group: every rank then accepts or refuses the budget alike
        (no rank left waiting in a collective for one that raised), and `_spare_bytes` agrees."""
        need, what = self._group_need(*self.minimum_budget())
        self._spare_bytes = max(0, (self.manager.cpu.capacity or 0) - need)
        return need, what

    def _group_need(self, need: int, what: str) -> tuple[int, str]:
        worst = torch.tensor([float(need)], dtype=torch.float64)
        comm.all_reduce(worst, op="max", group=self.group)
        most = int(worst.item())
        if most > need:
            need, what = most, f"another rank's working set (here {what}, {need} bytes)"
        return need, what

    def _kept_bytes(self) -> int | None:
        """Bytes of unpinned gathered units that may stay for reuse (None: all, until the end of backward).

        Each unit dropped while a later module still needs it is all-gathered again (the no-decay
        group's unit serves every layer, and backward revisits them all). With RAM unbounded every
        unit stays until `_end_backward`, as DeepSpeed ZeRO-3 keeps parameters live below
        ``stage3_max_live_parameters``: one all-gather per unit per step. Under a budget the units
        that fit in what the budget leaves above the (group-wide) minimum stay, most recently used
        first, so the transient memory stays within the budget. Counted in bytes, as units differ
        in size (`_width`): a small group's unit costs what it holds, not a whole unit of chunks.
        The bytes, widths and order are the same on every rank, so every rank keeps the same units.
        """
        if self.memory_saving:
            return 0
        if self._on_dev:  # on a device whose budget may follow the activations: keep units only if unbounded
            return None if self.manager.dev.capacity is None else 0  # type: ignore[union-attr]
        return None if self.manager.cpu.capacity is None else self._spare_bytes

    def _gather(self, g: int, unit: int) -> None:
        """Materialize every chunk of a unit (symmetric on all ranks)."""
        key = (g, unit)
        if key in self._gathered:
            self._gathered[key] = self._gathered.pop(key)  # most recently used last
            return
        kept = self._kept_bytes()
        if kept is not None:
            idle = [k for k in self._gathered
                    if not any(h.pins for i in self._unit_indices(*k) for h in self._param_homes(k[0], i))]
            held = sum(self._gathered[k].nbytes for k in idle)
            for other in idle:  # least recently used first
                if held <= kept:
                    break
                held -= self._gathered[other].nbytes
                self._drop_unit(other)
        faults.crash_point("zero3.gather")
        self.unit_gathers += 1
        width = self._width(g, unit)
        indices = self._unit_indices(g, unit)
        buf = self._take_buffer(width * len(indices), self.dtype, f"gathered chunks of unit {key}")
        if self.memory_saving:
            (i,) = indices
            if self.owned(i):
                own = self.manager.access(self.chunks[ChunkKind.PARAM][g][i].chunk_id, compute=self._on_dev)
                buf.copy_(own.payload.narrow(0, 0, width))  # type: ignore[union-attr]
                self.manager.release(own.chunk_id)
            comm.broadcast(buf, src=self.owner(i), group=self.group)
        else:
            mine = next(i for i in indices if self.owned(i))
            own = self.manager.access(self.chunks[ChunkKind.PARAM][g][mine].chunk_id, compute=self._on_dev)
            mine_payload = own.payload.narrow(0, 0, width)  # type: ignore[union-attr]
            if self.quantized:
                comm.quantized_all_gather(buf, mine_payload, group=self.group)
            else:
                comm.all_gather(buf, mine_payload, group=self.group)
            self.manager.release(own.chunk_id)
        self.collective_elements += width
        self._gathered[key] = buf
        for pos, i in enumerate(indices):
            if not self.owned(i):
                chunk = self.chunks[ChunkKind.PARAM][g][i]
                chunk.payload = buf.narrow(0, pos * width, width)  # its used elements; the rest is padding
                self._bind(chunk)

    def _drop_unit(self, key: tuple[int, int]) -> None:
        g, unit = key
        remote = [i for i in self._unit_indices(g, unit) if not self.owned(i)]
        for i in remote:
            chunk = self.chunks[ChunkKind.PARAM][g][i]
            self._unbind(chunk)
            chunk.payload = None
        self._give_buffer(self._gathered.pop(key))

    def _param_homes(self, g: int, index: int) -> list[ParamHome]:
        return self._homes_in(self.chunks[ChunkKind.PARAM][g][index])

    # ---- access and release ---------------------------------------------------------------------
    def access_param(self, home: ParamHome) -> None:
        self._gather(home.group, self._unit(home.index))
        if self.owned(home.index):
            super().access_param(home)
            return
        chunk = self.chunk_of(home, ChunkKind.PARAM)
        chunk.set_state(home.slot, TensorState.COMPUTE)
        home.pins += 1

    def release_param(self, home: ParamHome, state: TensorState, all_pins: bool = False) -> None:
        if self.owned(home.index):
            super().release_param(home, state, all_pins)
            return
        count = home.pins if all_pins else min(home.pins, 1)
        home.pins -= count
        chunk = self.chunk_of(home, ChunkKind.PARAM)
        if home.pins == 0 and home.slot.state is TensorState.COMPUTE:
            chunk.set_state(home.slot, state)

    # ---- gradients ------------------------------------------------------------------------------
    def _grad_key(self, home: ParamHome) -> tuple[int, int]:
        return (home.group, home.index) if self.memory_saving else (home.group, self._unit(home.index))

    def grad_arrived(self, home: ParamHome, grad: torch.Tensor) -> None:
        key = self._grad_key(home)
        buf = self._grad_bufs.pop(key, None)
        if buf is None:
            if len(self._grad_bufs) >= self._open_cap:
                # Gradients arrive out of layout order (tied weights, order="modules" on a model
                # built in another order than it runs): reduce the longest idle buffer now, partly
                # filled (the owner's GRAD chunk adds up), so the open buffers stay within the budget.
                self._flush(next(iter(self._grad_bufs)))
            buf = self._take_buffer(self._span * self._width(*key), torch.float32, f"gradient buffer of unit {key}")
            self._grad_slots[key] = {}
        self._grad_bufs[key] = buf  # re-inserted: the dict's order is least recently used first
        pos = 0 if self.memory_saving else home.index % self.group.size
        start = pos * self._width(*key) + home.slot.offset
        slots = self._grad_slots[key]
        if start in slots:  # a second gradient for this slot (a weight used twice): add
            buf.narrow(0, start, home.slot.numel).add_(grad.reshape(-1))
        elif home.slot.numel:  # the first: the buffer is not cleared beforehand, so write it (`_flush` zeroes the rest)
            buf.narrow(0, start, home.slot.numel).copy_(grad.reshape(-1))
            slots[start] = start + home.slot.numel
        self._grad_missing[key] -= 1
        if self._grad_missing[key] == 0:
            self._flush(key)
            # Several backwards may run before `finish_backward` (a pipeline's micro-batches): the
            # next one's gradients of this unit are counted afresh, so they are reduced as eagerly.
            self._grad_missing[key] = self._grad_expected[key]

    def _flush(self, key: tuple[int, int]) -> None:
        """Average a unit's gradients over the group into the owners' GRAD chunks (symmetric)."""
        buf = self._grad_bufs.pop(key)
        pos = 0
        for start, end in sorted(self._grad_slots.pop(key).items()):  # zero what no gradient wrote
            if start > pos:
                buf[pos:start].zero_()
            pos = max(pos, end)
        if pos < buf.numel():
            buf[pos:].zero_()
        g, idx = key
        width = self._width(g, idx)
        self.collective_elements += buf.numel()
        if self.memory_saving:
            owner = self.owner(idx)
            comm.reduce(buf, dst=owner, op="avg", group=self.group)
            if owner == self.group.rank:
                self._add_grad(g, idx, buf, width)
        else:
            mine = next(i for i in self._unit_indices(g, idx) if self.owned(i))
            grad_id = self.chunks[ChunkKind.GRAD][g][mine].chunk_id
            if self.manager.reads_as_zeros(grad_id):  # this step's first reduction: straight into the chunk
                grad = self.manager.access(grad_id, overwrite=True, compute=self._on_dev).payload.narrow(0, 0, width)  # type: ignore[union-attr]
                self._reduce_scatter(grad, buf)
                self.manager.release(grad_id)
            else:  # the unit was flushed before in this step (partly filled, or an earlier micro-batch)
                self.manager.reserve_transient(width * 4, f"reduced gradient chunk of unit {key}", self._on_dev)
                shard = torch.empty(width, device=self._buf_device)
                self._reduce_scatter(shard, buf)  # buf is freed next
                self._add_grad(g, mine, shard, width)
                del shard
                self.manager.release_transient(width * 4, self._on_dev)
        self._give_buffer(buf)

    def _reduce_scatter(self, out: torch.Tensor, buf: torch.Tensor) -> None:
        """This rank's part of the group average of `buf` into `out` (`buf` may be overwritten)."""
        if self.quantized:
            comm.quantized_reduce_scatter(out, buf, group=self.group)
            out.div_(self.group.size)
        else:
            comm.reduce_scatter(out, buf, op="avg", group=self.group, overwrite_input=True)

    def _add_grad(self, g: int, index: int, reduced: torch.Tensor, width: int) -> None:
        """Add a reduced gradient into the owned GRAD chunk `index` (copy it, if the chunk holds none)."""
        grad_id = self.chunks[ChunkKind.GRAD][g][index].chunk_id
        on = self._on_dev  # where the reduction ran (the device, with a device tier)
        if self.manager.reads_as_zeros(grad_id):
            self.manager.access(grad_id, overwrite=True, compute=on).payload.narrow(0, 0, width).copy_(reduced)  # type: ignore[union-attr]
        else:
            self.manager.access(grad_id, write=True, compute=on).payload.narrow(0, 0, width).add_(reduced)  # type: ignore[union-attr]
        self.manager.release(grad_id)

    def _end_backward(self) -> None:
        for key in sorted(self._grad_bufs):  # units with unused parameters: same order everywhere
            self._flush(key)
        self._reset_grad_counts()
        for key in list(self._gathered):
            self._drop_unit(key)

    def _reset_grad_counts(self) -> None:
        """Gradients each unit waits for before it is reduced (parameters that require grad)."""
        self._grad_missing = {}
        for home in self.homes.values():
            if home.param.requires_grad:
                key = self._grad_key(home)
                self._grad_missing[key] = self._grad_missing.get(key, 0) + 1
        self._grad_expected = dict(self._grad_missing)
        self._open_cap = self._grad_cap()

    def drop_remote(self) -> None:
        """Free every gathered remote chunk (e.g. after an eval forward)."""
        for key in list(self._gathered):
            self._drop_unit(key)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        # Remote values come from the gathered PARAM chunks (16-bit in mixed precision), gathered exactly
        # (not quantized): every rank gets the owners' values.
        # Between steps: its gathers and reads are no moments of a step (the chunk manager's off_trace).
        with self.manager.off_trace():
            quantized, self.quantized = self.quantized, False
            try:
                if quantized:
                    self.drop_remote()  # units gathered in int8 must not stand in for the exact values
                for home in self.homes.values():
                    self._gather(home.group, self._unit(home.index))
                    chunk: Chunk = self.chunk_of(home, ChunkKind.PARAM)
                    if self.owned(home.index):
                        chunk = self.manager.access(chunk.chunk_id)
                        out[home.name] = chunk.view(home.slot).to("cpu", torch.float32, copy=True)
                        self.manager.release(chunk.chunk_id)
                    else:  # a copy in RAM: the gathered buffer is reused (or on the device)
                        out[home.name] = chunk.view(home.slot).to("cpu", torch.float32, copy=True)
                self.drop_remote()
            finally:
                self.quantized = quantized
        return out
