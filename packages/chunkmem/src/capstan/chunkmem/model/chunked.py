"""`ChunkedModel`: a module whose parameters, gradients and Adam moments live in chunks.

Registration packs the parameters (module by module, in module order, which
is execution order for sequential models, or with `order="trace"` in the
order one traced forward first calls the modules: order.py) into PARAM chunks, with sibling
GRAD, EXP_AVG and EXP_AVG_SQ chunks at the same offsets so the optimizer
works chunk by chunk. Pure-fp32 mode: the PARAM chunk is the master copy.

Hooks (hooks.py) move the data, PatrickStar's scheme: a module's forward
accesses its parameters' chunks and releases them after, its backward
re-accesses them, and each gradient lands in its chunk.

Driving backward from outside (a pipeline schedule calls
`torch.autograd.backward` on stage outputs, several micro-batches in
flight): run the forwards and backwards inside `saved_tensors()` and call
`finish_backward()` once they are all done, instead of `forward`/`backward`.

Gradient norm over other parallel axes: `norm_weights` (one factor per
parameter group, e.g. 0 for a group replicated on another rank that counts
it already) and `outer_groups` (process groups whose ranks hold disjoint or
sliced parameters: tensor- and pipeline-parallel groups) make `reduce_sq`
and `reduce_any` global; chunkmem knows nothing of what the groups are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from capstan import comm
from capstan.comm import Group

from ..memory.manager import BudgetError, ChunkManager
from . import moment_layout
from .budget import MinimumBudget
from .chunk import Chunk, TensorSlot
from .hooks import install_hooks
from .layout import ModuleSpec, ParamSpec, auto_chunk_size, group_lists, list_capacity
from .moment_layout import BLOCK as Q8_BLOCK
from .moment_layout import Q8Layout
from .order import module_order
from .saved import ChunkViewSaver
from .states import ChunkKind, TensorState

__all__ = ["ChunkedModel", "ParamHome", "MOMENT_KINDS", "Q8_BLOCK"]

MOMENT_KINDS = (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)


_EMPTY = torch.empty(0)


@dataclass(eq=False)
class ParamHome:
    """Where one parameter lives: its chunk index, slot, and current pin count."""

    param: nn.Parameter
    name: str
    index: int  # position in the chunk list (same for all kinds)
    slot: TensorSlot
    group: int = 0
    pins: int = 0
    canonical: int = 0  # its first element's place in the canonical parameter order (`rounding_spans`)
    grad_in_slot: bool = False  # slot-reuse mode: the PARAM slot holds this step's gradient


class ChunkedModel(MinimumBudget, nn.Module):
    """Wraps `module` so its parameters live in chunks managed by `manager`.

    chunk_size: elements per chunk; None picks the least-waste size for this model and its chunk
    lists (`layout.auto_chunk_size`, padding included) and `self.chunk_size` then holds it.
    param_groups: optional list of lists of parameter names, one chunk list per group (so each
    chunk has one set of optimizer hyper-parameters); parameters not listed go to group 0. A group
    whose list ends in slivers of a chunk gets a second, small list for them after all the groups'
    (`layout.split_list_ends`); `list_group[l]` is list l's group.
    order: "modules" packs modules in creation order (`named_modules()`); "trace" in the order
    one forward on `example_inputs` (a tuple of positional arguments, run without gradients, on
    the meta device for a meta-device model) first calls them, uncalled modules last (order.py).
    """

    _gathers = False  # True where chunks live on other ranks and hooks gather them (sharding.py)

    def __init__(self, module: nn.Module, manager: ChunkManager, chunk_size: int | None,
                 param_groups: list[list[str]] | None = None,
                 atomic_types: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,),
                 dtype: torch.dtype = torch.float32, accumulate_grads: bool = False,
                 init_fn: Callable[[nn.Module], None] | None = None,
                 norm_weights: Sequence[float] | None = None, outer_groups: Sequence[Group] = (),
                 order: str = "modules", example_inputs: Sequence[object] | None = None,
                 report_grads: bool = False, moment_dtype: torch.dtype = torch.float32,
                 master_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.init_fn = init_fn
        # report_grads: every parameter's gradient hook calls `grad_listener(group, index)` once its
        # gradient is in its chunk (the overlapped optimizer step listens, overlap.py); hooks are
        # installed for it even where chunks stay put.
        self.report_grads = report_grads
        self.grad_listener: Callable[[int, int], None] | None = None
        # Set while chunk groups have an update left for the next forward (`ChunkAdam.pending`): the forward
        # hooks call it with a module's (group, index) pairs before they access its parameters.
        self.pending_update: Callable[[int, int], None] | None = None
        n_groups = max(1, len(param_groups or []))
        if norm_weights is not None and len(norm_weights) != n_groups:
            raise ValueError(f"{len(norm_weights)} norm weights for {n_groups} parameter groups")
        self.norm_weights = [float(w) for w in norm_weights] if norm_weights is not None else [1.0] * n_groups
        self.outer_groups = tuple(outer_groups)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"chunk dtype must be float32, bfloat16 or float16, got {dtype}")
        self.dtype = dtype
        # A bf16 master (master_dtype = bf16, with dtype bf16): no fp32 copy; the PARAM chunk is the master,
        # stepped in fp32 by the kernel and stored with stochastic rounding (kernels.adam_update with a bf16
        # param), and the gradients keep autograd's bf16 in chunks of their own: 2 + 2 bytes a parameter
        # where the fp32 master takes 2 + 4 (its gradient in the PARAM slot), before the moments.
        if master_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"master dtype must be float32 or bfloat16, got {master_dtype}")
        if master_dtype == torch.bfloat16 and dtype != torch.bfloat16:
            raise ValueError(f"a bf16 master needs bf16 parameters (dtype=torch.bfloat16), got {dtype}")
        self.master_dtype = master_dtype
        self.bf16_master = master_dtype == torch.bfloat16
        self.mixed = dtype != torch.float32 and not self.bf16_master  # a 16-bit PARAM beside an fp32 MASTER
        # Adam's moments: fp32, or bf16 chunks (half the bytes in every tier) that `ChunkAdam` updates in
        # fp32 and stores with stochastic rounding (capstan.native.kernels.adam_update), or 8-bit ones
        # (torch.uint8: a quarter, block-wise quantized; each moment chunk holds its codes at the
        # parameters' offsets, then one fp32 scale per block: `q8_layout`, kernels.adam_update_q8).
        if moment_dtype not in (torch.float32, torch.bfloat16, torch.uint8):
            raise ValueError(f"moment dtype must be float32, bfloat16 or uint8 (8-bit), got {moment_dtype}")
        self.moment_dtype = moment_dtype
        self.q8 = moment_dtype == torch.uint8
        self._q8: dict[tuple[int, int], Q8Layout] = {}
        # Gradients get chunks of their own (fp32; bf16 beside a bf16 master) in pure-fp32 mode and with a
        # bf16 master (the PARAM chunk is the master and must survive backward) and under gradient
        # accumulation (several backwards add up).
        # Otherwise a 16-bit gradient reuses its parameter's slot once that parameter's backward
        # use is over: 2 + 4 + 4 + 4 = 14 bytes per parameter (PatrickStar section 4).
        self.grad_chunks = not self.mixed or accumulate_grads or self._needs_grad_chunks()
        # Modules whose forward reads submodules' parameters directly (MultiheadAttention uses
        # out_proj.weight without calling out_proj): their whole subtree is accessed at once.
        self.atomic_types = atomic_types
        self.module = module
        self.manager = manager
        self.chunk_size = chunk_size
        self.homes: dict[int, ParamHome] = {}  # id(param) -> home
        self._by_chunk: dict[int, list[ParamHome]] = {}  # PARAM chunk id -> its parameters
        self.chunks: dict[ChunkKind, list[list[Chunk]]] = {}
        self.saver = ChunkViewSaver()
        # Callbacks first: registering later chunks may already evict earlier ones.
        manager.on_resident.append(self._bind)
        manager.on_evict.append(self._unbind)
        self._register(param_groups, module_order(module, order, example_inputs, atomic_types))
        self._number_elements(param_groups)
        self._spans: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        self._install_hooks()
        self._bind_resident_grads()
        self._check_budget()

    def _grads_bound(self) -> bool:
        # Not in mixed precision: autograd's gradient of a 16-bit parameter is 16-bit, the chunk fp32.
        # And not where a subclass handles arriving gradients itself (sharding.py reduces them).
        return (self.grad_chunks and not self.mixed and self._chunks_stay_put()
                and type(self).grad_arrived is ChunkedModel.grad_arrived)

    def _bind_resident_grads(self) -> None:
        """When RAM is unbounded and there is no disk tier, nothing ever moves: each `param.grad`
        is bound to its GRAD chunk slot once, so autograd accumulates straight into the chunk
        (no per-step gradient allocation, no copy into the chunk)."""
        self.resident_grads = self._grads_bound()
        if not self.resident_grads:
            return
        for home in self.homes.values():
            chunk = self.manager.access(self.chunk_of(home, ChunkKind.GRAD).chunk_id, write=True)
            home.param.grad = chunk.view(home.slot)
            self.manager.release(chunk.chunk_id)

    # ---- registration -------------------------------------------------------------------------
    def _register(self, param_groups: list[list[str]] | None, modules: list[tuple[str, nn.Module]]) -> None:
        named = dict(self.module.named_parameters())
        group_of = {n: g for g, names in enumerate(param_groups or []) for n in names}
        unknown = sorted(set(group_of) - set(named))
        if unknown:
            raise ValueError(f"param_groups name parameters the model does not have: {unknown}")
        n_groups = max(1, len(param_groups or []))
        specs: list[list[ModuleSpec]] = [[] for _ in range(n_groups)]
        names_by_id = {id(p): n for n, p in named.items()}
        owner: dict[int, nn.Module] = {}
        seen: set[int] = set()
        for mod_name, mod in modules:
            for p in mod.parameters(recurse=False):
                owner.setdefault(id(p), mod)
            own: list[list[ParamSpec]] = [[] for _ in range(n_groups)]
            for p in mod.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = names_by_id[id(p)]
                own[group_of.get(name, 0)].append(ParamSpec(name, p.numel()))
            for g in range(n_groups):
                if own[g]:
                    specs[g].append(ModuleSpec(mod_name, tuple(own[g])))
        next_id = 0
        sized_here = self.chunk_size is None
        if sized_here:
            self.chunk_size = auto_chunk_size(specs, pad=self._padded_count)
        capacity, one = self.manager.cpu.capacity, self.chunk_size * 4  # fp32 kinds are the largest
        if capacity is not None and capacity < one:
            raise BudgetError(f"cpu budget of {capacity} bytes cannot hold one chunk of {self.chunk_size} "
                              f"elements ({one} bytes{', the size chosen for this model' if sized_here else ''})")
        # One chunk list per parameter group, and after them a side list for a group whose end chunks hold
        # slivers (layout.split_list_ends): list l steps with parameter group list_group[l]'s hyper-parameters
        # and counts in the norm with its weight.
        lists = group_lists(specs, self.chunk_size, self._padded_count)
        self.list_group = [g for g, _ in lists]
        self.n_param_groups = n_groups
        self.norm_weights = [self.norm_weights[g] for g in self.list_group]
        for kind in self.kinds():
            self.chunks[kind] = [[] for _ in self.list_group]
        for g, (_, plan) in enumerate(lists):
            size = list_capacity(plan, self.chunk_size)  # a small group's chunks are small
            plan += [[] for _ in range(self._padded_count(len(plan)) - len(plan))]
            stateful = self._state_capacities(size)
            for index, members in enumerate(plan):
                init = torch.zeros(size)
                for kind in self.chunks:
                    if kind in stateful:  # a state of its own beside the list, holding no parameter
                        self.chunks[kind][g].append(Chunk(next_id, kind, torch.float32, stateful[kind]))
                        next_id += 1
                        continue
                    chunk = Chunk(next_id, kind, self._chunk_dtype(kind), self._kind_capacity(kind, size, members))
                    next_id += 1
                    for spec, offset in members:
                        p = named[spec.name]
                        slot = chunk.add(spec.name, p.shape, offset)
                        if kind is ChunkKind.PARAM:
                            if p.is_meta:
                                self._materialize(owner[id(p)], named, owner)
                                p = named[spec.name]
                            init.narrow(0, offset, p.numel()).copy_(p.detach().reshape(-1))
                            home = ParamHome(p, spec.name, index, slot, g)
                            self.homes[id(p)] = home
                            self._by_chunk.setdefault(chunk.chunk_id, []).append(home)
                    self.chunks[kind][g].append(chunk)
                for spec, _ in members:
                    named[spec.name].data = _EMPTY  # the chunks are the only copy from now on
                self._place(g, index, init)

    def _materialize(self, module: nn.Module, named: dict[str, nn.Parameter], owner: dict[int, nn.Module]) -> None:
        """Give a meta-device module real parameters, one module at a time, so a model far larger
        than RAM is built straight into chunks: `reset_parameters()` (or the `init_fn` given to the
        constructor) initializes them; the chunks take the values and the module's copy is dropped.

        `to_empty` creates new Parameter objects; every other reference to the old ones (tied
        weights in other modules) and the name table are pointed at the new ones, and the new ones
        keep the old ones' attributes (tensor-parallel marks such as `tp_dim`)."""
        old = dict(module._parameters)
        module.to_empty(device="cpu", recurse=False)
        for attr, old_p in old.items():
            new_p = module._parameters[attr]
            if old_p is None or new_p is old_p:
                continue
            new_p.__dict__.update(old_p.__dict__)
            for mod in self.module.modules():
                for a, q in list(mod._parameters.items()):
                    if q is old_p:
                        mod._parameters[a] = new_p
            for name, q in list(named.items()):
                if q is old_p:
                    named[name] = new_p
            owner[id(new_p)] = owner.pop(id(old_p), module)
        with torch.no_grad():
            if self.init_fn is not None:
                self.init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()  # type: ignore[operator]
            else:
                raise ValueError(
                    f"{type(module).__name__} was built on the meta device but has no reset_parameters(); "
                    "pass init_fn= to ChunkedModel to initialize it"
                )

    def kinds(self) -> list[ChunkKind]:
        """The chunk lists this model keeps (sibling chunks share offsets)."""
        kinds = [ChunkKind.PARAM]
        if self.mixed:
            kinds.append(ChunkKind.MASTER)
        if self.grad_chunks:
            kinds.append(ChunkKind.GRAD)
        return kinds + [ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ]

    def _number_elements(self, param_groups: list[list[str]] | None) -> None:
        """Number every element in the canonical order: the groups in order, each group's parameters as
        `param_groups` lists them (unlisted ones, in group 0, after its listed ones in module order). It is
        independent of how chunks pack them (module or trace order, sharding, padding), and it is the
        order of capstan.engine's flat ZeRO buffer, so bf16 moments round alike in every layout."""
        place = {n: (g, 0, k) for g, names in enumerate(param_groups or []) for k, n in enumerate(names)}
        for k, n in enumerate(dict(self.module.named_parameters(remove_duplicate=False))):
            place.setdefault(n, (0, 1, k))
        pos = 0
        for home in sorted(self.homes.values(), key=lambda h: place.get(h.name, (0, 1, 0))):
            home.canonical = pos
            pos += home.slot.numel

    def rounding_spans(self, g: int, i: int) -> list[tuple[int, int, int]]:
        """Chunk `i` of group `g` as runs of slots consecutive in the canonical order (moment_layout.py);
        the stochastic rounding of bf16 moments draws from the canonical index (optim/moments.py)."""
        key = (g, i)
        if key not in self._spans:
            self._spans[key] = moment_layout.rounding_spans(self._slots(g, i))
        return self._spans[key]

    def _slots(self, g: int, i: int) -> list[tuple[str, int, int, int]]:
        """(name, slot offset, numel, canonical index) of each parameter in chunk `i` of group `g`."""
        return [(h.name, h.slot.offset, h.slot.numel, h.canonical)
                for h in self._homes_in(self.chunks[ChunkKind.PARAM][g][i])]

    def _kind_capacity(self, kind: ChunkKind, size: int, members: list) -> int:
        """Elements of a chunk of `kind` beside a list of `size`-element chunks: `size`, but an 8-bit
        moment chunk also holds its parameters' block scales (fp32, after the codes, 64-byte aligned), and
        is a whole number of 4 KiB pages (the disk tier's direct I/O moves whole pages)."""
        if not (self.q8 and kind in MOMENT_KINDS):
            return size
        return moment_layout.chunk_bytes(size, sum(-(-spec.numel // Q8_BLOCK) for spec, _ in members))

    def q8_layout(self, g: int, i: int) -> Q8Layout:
        """Chunk `i` of group `g` as 8-bit moments see it: one segment per parameter (slot offset, numel,
        canonical index of its first element), in slot order, and where the block scales start."""
        key = (g, i)
        if key not in self._q8:
            self._q8[key] = moment_layout.q8_layout(self._slots(g, i), self.chunks[ChunkKind.PARAM][g][i].capacity)
        return self._q8[key]

    def moment_layout(self, g: int, i: int) -> list[tuple[int, int, int]] | Q8Layout:
        """What optim/moments.py step_chunk needs of chunk group (g, i): its 8-bit layout, or its rounding spans."""
        return self.q8_layout(g, i) if self.q8 else self.rounding_spans(g, i)

    def step_view(self, kind: ChunkKind, payload: torch.Tensor, n: int) -> torch.Tensor:
        """What the optimizer's kernels get of a chunk's payload: its first `n` elements, but the whole
        payload of an 8-bit moment chunk (codes and scales: optim/moments.py step_chunk)."""
        return payload if self.q8 and kind in MOMENT_KINDS else payload[:n]

    def _chunk_dtype(self, kind: ChunkKind) -> torch.dtype:
        if kind is ChunkKind.PARAM:
            return self.dtype
        if kind is ChunkKind.GRAD:
            return self._grad_dtype()
        return self.moment_dtype if kind in (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ) else torch.float32

    def _grad_dtype(self) -> torch.dtype:
        """GRAD chunks: fp32, but a bf16 master's hold autograd's bf16 gradients as they arrive (several
        backwards add up in bf16, as a bf16 parameter's .grad does in plain PyTorch)."""
        return self.dtype if self.bf16_master else torch.float32

    def _state_capacities(self, size: int) -> dict[ChunkKind, int]:
        """Chunk kinds among `kinds()` that hold a state of their own rather than the parameters' (1-bit
        Adam's residuals, replicated.py), with their capacity beside a list of `size`-element chunks."""
        return {}

    def _needs_grad_chunks(self) -> bool:
        """Sharding always reduces gradients into chunks of their own."""
        return False

    def _padded_count(self, n: int) -> int:
        """How many chunks a list of `n` needs (sharding pads to a multiple of the group size)."""
        return n

    def _place(self, g: int, index: int, init: torch.Tensor) -> None:
        """Hand chunk `index` of group `g` to the manager. Parameters start resident as far as the
        budget allows; Adam moments and gradients start as zeros that take memory once touched."""
        param_chunk = self.chunks[ChunkKind.PARAM][g][index]
        self.manager.add(param_chunk, init)
        if self.mixed:
            self.manager.add(self.chunks[ChunkKind.MASTER][g][index], init)
        for kind in self.kinds()[1 + self.mixed:]:
            self.manager.add(self.chunks[kind][g][index])
        if param_chunk.payload is not None and self.manager.dev is None:
            self._bind(param_chunk)
        elif self.manager.dev is not None:  # bound when a forward first brings the chunk onto the device
            for home in self._homes_in(param_chunk):
                home.param.data = _EMPTY

    def owned_indices(self, g: int) -> list[int]:
        """Chunk indices of group `g` whose optimizer state this rank keeps (all, unsharded)."""
        return list(range(len(self.chunks[ChunkKind.PARAM][g])))

    def _reduction_groups(self) -> list[Group]:
        """Groups a gradient statistic is reduced over: the shard group (sharding.py), then the outer ones."""
        return [g for g in self.outer_groups if g.size > 1]

    def reduce_sq(self, local_sum_of_squares: float) -> float:
        """Sum of (already weighted) squared gradients over all shards and the outer groups."""
        groups = self._reduction_groups()
        if not groups:
            return local_sum_of_squares
        t = torch.tensor([local_sum_of_squares], dtype=torch.float64)
        for group in groups:
            comm.all_reduce(t, group=group)
        return float(t.item())

    def reduce_any(self, flag: bool) -> bool:
        """True if `flag` is set on any rank of the shard and outer groups (an overflow anywhere)."""
        groups = self._reduction_groups()
        if not groups:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        for group in groups:
            comm.all_reduce(t, op="max", group=group)
        return bool(t.item())

    def chunk_of(self, home: ParamHome, kind: ChunkKind) -> Chunk:
        return self.chunks[kind][home.group][home.index]

    def _bind(self, chunk: Chunk) -> None:
        if chunk.kind is not ChunkKind.PARAM:
            return
        self.saver.resident(chunk)
        for home in self._homes_in(chunk):
            home.param.data = chunk.view(home.slot)

    def _unbind(self, chunk: Chunk) -> None:
        if chunk.kind is not ChunkKind.PARAM:
            return
        self.saver.leaving(chunk)
        for home in self._homes_in(chunk):
            home.param.data = _EMPTY

    def _homes_in(self, chunk: Chunk) -> list[ParamHome]:
        return self._by_chunk.get(chunk.chunk_id, [])

    # ---- access and release: the interface the hooks (hooks.py) drive; the sharded model overrides it ----
    def access_param(self, home: ParamHome) -> None:
        """Make a parameter's chunk resident in the compute tier for its module's forward or backward and pin
        it (once per use: a parameter shared by several modules is pinned once per module)."""
        chunk = self.chunk_of(home, ChunkKind.PARAM)
        self.manager.access(chunk.chunk_id, compute=True)
        chunk.set_state(home.slot, TensorState.COMPUTE)
        home.pins += 1

    def release_param(self, home: ParamHome, state: TensorState, all_pins: bool = False) -> None:
        """Unpin one use of a parameter (`all_pins`: every use, after its gradient arrived); once none is
        left its slot takes `state` (HOLD_AFTER_FWD, HOLD_AFTER_BWD), and its chunk may move."""
        chunk = self.chunk_of(home, ChunkKind.PARAM)
        count = home.pins if all_pins else min(home.pins, 1)
        for _ in range(count):
            self.manager.release(chunk.chunk_id)
        home.pins -= count
        if home.pins == 0 and home.slot.state is TensorState.COMPUTE:
            chunk.set_state(home.slot, state)

    def module_homes(self, module: nn.Module) -> list[ParamHome]:
        """The parameters a module's hooks access: its own, or its whole subtree's for an atomic module."""
        recurse = isinstance(module, self.atomic_types)
        return [self.homes[id(p)] for p in module.parameters(recurse=recurse) if id(p) in self.homes]

    def hooked_modules(self) -> Iterator[nn.Module]:
        """Modules that get hooks: all, except those inside an atomic module."""
        inside: set[int] = set()
        for module in self.module.modules():
            if id(module) in inside:
                continue
            if isinstance(module, self.atomic_types):
                inside.update(id(m) for m in module.modules() if m is not module)
            yield module

    def _chunks_stay_put(self) -> bool:
        """True when no chunk can ever leave RAM: the budget is unbounded, there is no disk tier and
        no chunk lives on another rank. Every parameter then stays bound to its chunk slot for good,
        and the per-module access/release hooks and the saved-tensor hooks would only count pins
        (7-8 ms of a 200 ms step on a small GPT, docs/chunkmem.md): they are left out."""
        mgr = self.manager
        return mgr.cpu.capacity is None and mgr.disk is None and mgr.dev is None and not self._gathers

    def _install_hooks(self) -> None:
        self.static = self._chunks_stay_put()
        grads = self.report_grads or not (self.static and self._grads_bound())
        install_hooks(self, modules=not self.static, grads=grads)

    def grad_arrived(self, home: ParamHome, grad: torch.Tensor) -> None:
        """Accumulate one gradient into its GRAD chunk slot, or store it in its parameter's slot."""
        kind = ChunkKind.GRAD if self.grad_chunks else ChunkKind.PARAM
        chunk = self.chunk_of(home, kind)
        self.manager.access(chunk.chunk_id, write=True, compute=True)  # where autograd left the gradient
        if self.grad_chunks:
            chunk.view(home.slot).add_(grad)
        else:  # the parameter's value is not needed again before the step: its master holds it
            chunk.view(home.slot).copy_(grad)
            home.grad_in_slot = True
        self.manager.release(chunk.chunk_id)

    def _end_backward(self) -> None:
        """Called once backward is over: in slot-reuse mode a parameter that got no gradient has
        its slot zeroed (its value lives on in the master chunk and is cast back by the step)."""
        if self.grad_chunks:
            return
        for home in self.homes.values():
            if not home.grad_in_slot:
                chunk = self.manager.access(self.chunk_of(home, ChunkKind.PARAM).chunk_id, write=True, compute=True)
                chunk.view(home.slot).zero_()
                self.manager.release(chunk.chunk_id)
                home.grad_in_slot = True

    # ---- training-step API ----------------------------------------------------------------------
    def saved_tensors(self) -> AbstractContextManager[None]:
        """The saved-tensor hooks `forward` runs under: views of parameter chunks that autograd saves
        are kept as references (saved.py). Wrap forwards made by calling submodules directly (a
        pipeline executor running this model's stage chunks) in it. Where chunks stay put there is
        nothing to guard against and autograd saves tensors as usual."""
        if self.static:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.saver.pack, self.saver.unpack)

    def forward(self, *args: object, **kwargs: object) -> object:
        with self.saved_tensors():
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the chunked model; every parameter ends released, its gradient in chunks."""
        loss.backward()
        self.finish_backward()

    def finish_backward(self) -> None:
        """End of a backward driven elsewhere (e.g. `torch.autograd.backward` on pipeline stage outputs,
        one call per micro-batch): call once after the last of them. Releases parameters that got no
        gradient, and (sharded) reduces the gradients still buffered to their owners."""
        for home in self.homes.values():  # parameters that received no gradient this time
            if home.pins:
                self.release_param(home, TensorState.HOLD, all_pins=True)
        self._end_backward()

    def named_chunk_params(self) -> Iterator[tuple[str, ParamHome]]:
        for home in self.homes.values():
            yield home.name, home

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter (loading chunks one at a time) in fp32, a bf16 master's widened exactly
        (as the sharded model's): for checks and export."""
        out: dict[str, torch.Tensor] = {}
        kind = ChunkKind.MASTER if self.mixed else ChunkKind.PARAM  # the master (fp32, or a bf16 master)
        run = self.pending_update  # an update left for the next forward (adam.py): run it first
        with self.manager.off_trace():  # between steps: its accesses are no moments of a step
            for home in self.homes.values():
                if run is not None:
                    run(home.group, home.index)
                chunk = self.manager.access(self.chunk_of(home, kind).chunk_id)
                out[home.name] = chunk.view(home.slot).to(torch.float32, copy=True)
                self.manager.release(chunk.chunk_id)
        return out
