"""memory.cpu_budget for a disk tier asked for without one: chosen from this machine's RAM.

    cfg = with_default_cpu_budget(cfg, groups)    # before the model is built; a no-op unless
                                                  # offload = "disk" and cpu_budget is unset

A disk tier keeps ``memory.cpu_budget`` bytes of chunks in RAM and the rest on
disk. DeepSpeed's ZeRO-Infinity configs (``offload_param`` / ``offload_optimizer``
to ``nvme``) have no such key, so unset it is chosen here, per rank::

    cpu_budget = HEADROOM x (available / ranks on this node - activations)

* **available**: ``MemAvailable`` (/proc/meminfo: free RAM plus what the kernel
  can reclaim without swapping), or less where a memory cgroup (a container)
  limits this process: the tightest limit minus that cgroup's working set (usage
  less inactive page cache, as the kubelet counts it). Read once every rank is up,
  so the interpreter, torch and the training text already loaded are not in it;
  every rank takes the smallest value any rank read (one budget for the run).
* **ranks on this node**: the launcher's local world size; they share its RAM evenly.
* **activations**: what a step allocates in RAM besides chunks. For the reference
  GPT computing on the CPU, the planner's estimate (plan/memory.py: the blocks'
  saved activations, one block's activation gradients, the loss's logits, ...).
  Where chunks compute on a GPU the activations live there: none (unless
  ``memory.activation_offload`` brings them back to RAM). For a model the
  planner cannot see (transformers, a module of one's own) nothing is known
  before its first step: ``ACTIVATION_SHARE`` (a quarter) of the rank's share is
  left to them.
* **HEADROOM** = 0.9: the allocator's slack and whatever the estimate leaves
  out; the planner's search picks disk budgets with the same factor (plan/layout_search.py).

Never below the chunks' minimum (chunkmem's ``minimum_budget``: what one module or
one optimizer step over a chunk group holds at once; for the reference GPT the
planner knows it before the model exists, for other models chunkmem checks it when
the model is chunked): where the RAM left after the activations cannot hold it,
one `ConfigError` names every number. The choice and how it was derived are logged
once, on rank 0; an explicit ``memory.cpu_budget`` is used as given.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from capstan import comm
from capstan.comm.health.procmem import proc_kib
from capstan.comm.job.accelerator import is_accelerator

from ..config.load import ConfigError
from ..config.schema import Config
from ..report.metrics import human_bytes

__all__ = ["RamBudget", "with_default_cpu_budget", "derive_budget", "available_ram", "cgroup_room", "ram_room",
           "disk_room", "HEADROOM", "ACTIVATION_SHARE"]

log = comm.get_logger(__name__)

HEADROOM = 0.9  # of what is left after the activations: allocator slack, what the estimate misses
ACTIVATION_SHARE = 0.25  # of a rank's RAM left to the activations of a model the planner cannot see
MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class RamBudget:
    """How the default cpu_budget of a rank is derived (module docstring); `budget` is the result."""

    available: int  # bytes of RAM the node still has for the job
    source: str  # where `available` comes from
    ranks: int  # ranks on this node
    activations: int  # bytes a rank's step allocates in RAM besides chunks
    activations_from: str
    minimum: int  # bytes of chunks that must fit in RAM at once
    minimum_from: str

    @property
    def share(self) -> int:
        return self.available // self.ranks

    @property
    def budget(self) -> int:
        """HEADROOM x (share - activations), rounded down to a MiB, never below the minimum; a ConfigError where
        the RAM left after the activations cannot hold the minimum."""
        room = self.share - self.activations
        if room < self.minimum:
            raise ConfigError(
                f"memory.cpu_budget is not set and this machine's RAM cannot hold the chunks a disk tier needs: "
                f"{self._derivation()} leaves {human_bytes(max(room, 0))} per rank, below the "
                f"{human_bytes(self.minimum)} ({self.minimum} bytes) of chunks that must be in RAM at once, "
                f"{self.minimum_from}; free RAM, run fewer ranks on this node, use a smaller memory.chunk_size, "
                f"or set memory.cpu_budget")
        budget = int(HEADROOM * room)
        return max(budget - budget % (1 << 20), self.minimum)

    def _derivation(self) -> str:
        ranks = f"{self.ranks} rank{'s' if self.ranks > 1 else ''} on this node"
        what = (f", minus {human_bytes(self.activations)} for activations: {self.activations_from}" if self.activations
                else f" (activations: {self.activations_from})")
        return f"{self.source} {human_bytes(self.available)} / {ranks} = {human_bytes(self.share)}{what}"

    def describe(self) -> str:
        """The line the run logs: the budget and how it was derived."""
        return (f"memory.cpu_budget not set: using {human_bytes(self.budget)} of chunks in RAM per rank = "
                f"{HEADROOM:g} x ({self._derivation()}); at least {human_bytes(self.minimum)}, {self.minimum_from}. "
                "Set memory.cpu_budget to choose it")


def available_ram(all_cache: bool = False) -> tuple[int, str]:
    """Bytes of RAM this process can still have, and where the figure comes from: MemAvailable, or a
    memory cgroup's room where that is less (0 where neither can be read: not Linux). `all_cache`: the
    cgroup's active page cache counts as room too (`cgroup_room`)."""
    avail, source = proc_kib(MEMINFO, "MemAvailable"), "MemAvailable"
    room = cgroup_room(all_cache)
    if room is not None and (not avail or room < avail):
        return room, "the memory cgroup's limit less its " + ("usage but page cache" if all_cache else "working set")
    return avail, source


def ram_room() -> int:
    """This rank's share of the RAM still free (`available_ram` over the ranks on this node): what the
    overlapped optimizer's rollback copies may take, read at every step (chunkmem's overlap.py; unbounded
    where MemAvailable cannot be read, but a full memory cgroup is 0)."""
    avail, source = available_ram()
    if not avail and source == "MemAvailable":
        return 1 << 62
    return avail // _local_ranks()


def disk_room(directory: str | Path) -> int:
    """This rank's share of the free bytes of `directory`'s file system (the ranks on this node keep their
    disk tiers' files there side by side): what a guess's second disk slots may take (overlap.py)."""
    return shutil.disk_usage(directory).free // _local_ranks()


def _local_ranks() -> int:
    return max(1, comm.launch().local_world_size if comm.is_initialized() else 1)


def cgroup_room(all_cache: bool = False) -> int | None:
    """The bytes the memory cgroups of this process (and their ancestors) still allow: the tightest limit
    minus its cgroup's working set (usage less inactive page cache); None without a limit. Reads cgroup v2
    (memory.max) and v1 (memory.limit_in_bytes). `all_cache`: less all its page cache, active too, which the
    kernel reclaims before it kills (what a refusal must credit: machine/room.py); the working set is the
    cautious figure a budget is sized from."""
    best = None
    for d in _cgroup_dirs():
        for limit_file, usage_file, prefix in (("memory.max", "memory.current", ""),
                                               ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_")):
            limit = _read_int(d / limit_file)
            if limit is None or limit >= _UNLIMITED:
                continue
            usage = _read_int(d / usage_file) or 0
            cache = sum(_stat(d / "memory.stat", prefix + key)
                        for key in (("inactive_file", "active_file") if all_cache else ("inactive_file",)))
            room = max(0, limit - max(0, usage - cache))
            best = room if best is None else min(best, room)
    return best


def _cgroup_dirs() -> list[Path]:
    """This process's memory cgroup directories, innermost first, up to the mount's root (inside a container
    whose cgroup is mounted as the root, the path /proc names is not there: its root is)."""
    try:
        lines = Path(PROC_CGROUP).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":
            base = CGROUP_ROOT  # v2
        elif "memory" in parts[1].split(","):
            base = CGROUP_ROOT / "memory"  # v1
        else:
            continue
        d = base / parts[2].lstrip("/")
        while True:
            if d.is_dir():
                out.append(d)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return out


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent, or "max" (v2: no limit)
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _planned(cfg: Config, world: int) -> tuple[int, int] | None:
    """(bytes of activations in RAM, the chunks' minimum budget) of the reference GPT on the CPU, from the
    planner (plan/memory.py, plan/chunks.py); None where it cannot model the run."""
    from ..plan.chunks import chunk_lists
    from ..plan.memory import memory_plan
    from ..plan.run import shape_layout
    from ..plan.spec import PlanError, local_machine, virtual_parts

    probe = replace(cfg, memory=replace(cfg.memory, cpu_budget=1 << 30))  # any budget: its items are left out
    try:
        shape, layout = shape_layout(probe, world)
        # the interpreter, torch and the text are loaded already (in MemAvailable): not counted again
        machine = replace(local_machine(ranks_per_node=world), host_overhead=0)
        plan = memory_plan(shape, machine, replace(layout, data_bytes=0))
        lay = plan.layout
        parts = virtual_parts(shape, lay)
        minimum = max(chunk_lists(shape, lay, sum((parts[k] for k in range(s, len(parts), lay.pp)), []))
                      .minimum_budget() for s in range(lay.pp))
    except PlanError:
        return None
    activations = sum(i.bytes for i in plan.items if i.tier == "ram" and not i.what.startswith("model states"))
    return activations, minimum


def derive_budget(cfg: Config, groups: comm.Groups, device: torch.device, reference_model: bool) -> RamBudget:
    """The derivation of the default budget (module docstring); collective over the world group."""
    mine, source = available_ram()
    agreed = comm.all_reduce(torch.tensor([mine], dtype=torch.int64), op="min", group=groups.world)
    available = int(agreed.item())
    if available <= 0:
        raise ConfigError("memory.offload = \"disk\" without memory.cpu_budget takes the budget from the RAM "
                          f"available ({MEMINFO}: MemAvailable), which cannot be read here: set memory.cpu_budget")
    if available < mine:
        source = "the least RAM available to any rank"
    ranks = _local_ranks()
    mem = cfg.memory
    floor = (mem.chunk_size or 1024) * 4, "one chunk (chunkmem checks this model's minimum when it is chunked)"
    gpu = is_accelerator(device)
    planned = _planned(cfg, groups.world.size) if reference_model and cfg.model.hf is None and not gpu else None
    if gpu and not mem.activation_offload:
        activations, why, (minimum, minimum_from) = 0, "none in RAM, they live on the GPU", floor
    elif planned is not None:
        activations, why = planned[0], "the planner's estimate"
        minimum, minimum_from = planned[1], "chunkmem's minimum for this model and chunk size"
    else:
        activations = int(ACTIVATION_SHARE * (available // ranks))
        why = f"{ACTIVATION_SHARE:.0%} of the share, this model's being unknown before its first step"
        minimum, minimum_from = floor
    return RamBudget(available, source, ranks, activations, why, minimum, minimum_from)


def with_default_cpu_budget(cfg: Config, groups: comm.Groups, *, reference_model: bool = True) -> Config:
    """`cfg` with memory.cpu_budget chosen from the machine where offload = "disk" leaves it unset (module
    docstring), logged once on rank 0; otherwise `cfg` itself. Collective over the world group (every rank
    calls it); reference_model: the model is the reference GPT of [model] (the planner estimates it)."""
    mem = cfg.memory
    if mem.offload != "disk" or mem.cpu_budget is not None:
        return cfg
    from ..model.models import resolve_device

    chosen = derive_budget(cfg, groups, resolve_device(cfg), reference_model)
    budget = chosen.budget
    comm.log_rank0(log, "%s", chosen.describe())
    return replace(cfg, memory=replace(mem, cpu_budget=budget))
