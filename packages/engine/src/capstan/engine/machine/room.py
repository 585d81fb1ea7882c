"""Model states against the machine's room: a run that cannot fit is refused at start.

    check_room_for_states(cfg, groups, params, resident, device_bytes, ...)   # every rank, before any chunk

Without it a run too large for its disk writes until the disk fills, minutes or hours into its first
step, and a run too large for RAM without a budget meets the out-of-memory killer. Once the model exists
(on the meta device where it is built into chunks, so nothing is allocated yet) every rank counts the
bytes of chunks its parameters keep all step at the least (`persistent_bytes_per_param`: no padding; their
gradients too, but where the overlapped optimizer past RAM drops them during backward; its 1/dp under
ZeRO-3), and the ranks compare them, summed per node, with what the node has:

* ``offload = "disk"``: what each rank's memory.cpu_budget, and a GPU's parameter chunks (at most its
  16-bit parameters' bytes, within the device's chunk limit), leave over must fit the free space of the
  file system of memory.disk_dir (for root, the reserved blocks too), plus the blocks of the chunk files
  the node's ranks' last run left there (a new run empties them);
* ``offload = "cpu"`` without memory.cpu_budget (RAM unbounded): the states less the parameters already
  in RAM (a model built before it was chunked: its tensors are freed into the chunks) must fit the RAM
  available (MemAvailable, or a memory cgroup's limit less its usage but its page cache) plus free swap
  (on a GPU the parameter and gradient chunks' host buffers are pinned and cannot swap, but the masters
  and moments, most of the bytes, can: swap counts, as a lower bound must);
* ``offload = "cpu"`` with a budget: the budget must hold this rank's whole states (`states_fit_error`;
  the config check did so already where one rank holds the whole reference GPT).

A memory.disk_dir this process cannot write, and a memory.overlap_optimizer = true this rank cannot run
(`overlap_error`: a pipeline stage with tied weights), are errors in the same collective.

The figures go round the world group (one all_gather), so every rank takes the same verdict: a node whose
disk is short fails every rank with one `ConfigError`, where a rank raising alone would leave the others
waiting in their next collective. A lower bound refuses only what cannot fit; a run it lets through can
still fill a disk that other files share.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import torch
from torch import nn

from capstan import comm
from capstan.comm.health.procmem import proc_kib

from ..config.load import ConfigError, drops_gradients, persistent_bytes_per_param, states_fit_error
from ..config.schema import Config
from ..report.metrics import human_bytes
from .ram_budget import MEMINFO, available_ram

__all__ = ["check_room_for_states", "resident_param_bytes", "device_param_bytes"]

BUDGET, DISK, RAM = 0, 1, 2  # what a rank's row checks (a budget alone, its node's disk, its node's RAM)


def resident_param_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s trainable parameters already in RAM (none for a model built on the meta device)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.device.type == "cpu")


def device_param_bytes(cfg: Config, params: int, limit: int) -> int:
    """The most of a rank's persistent chunk bytes a GPU can hold in place of RAM and disk: its 16-bit (fp32
    compute: 32-bit) parameter chunks, within the device's chunk limit; masters and moments stay on the host."""
    return min(limit, params * (4 if cfg.precision.dtype == "fp32" else 2))


def _existing(directory: str | Path) -> Path:
    """`directory`, or its nearest parent that exists (the file system it will be made on)."""
    where = Path(directory).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return where


def _node_key(*parts: object) -> int:
    """One int64 per node (and file system): the ranks that share a machine's RAM or a disk."""
    digest = hashlib.blake2b(repr((socket.gethostname(), *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _disk_free(where: Path) -> int:
    """Bytes this process may still write on `where`'s file system (the root of the machine may write the
    blocks reserved for it too; a root mapped in a user namespace, as in a rootless container, may not)."""
    st = os.statvfs(where)
    return (st.f_bfree if _real_root() else st.f_bavail) * st.f_frsize


def _real_root() -> bool:
    """Whether this process is the machine's root: uid 0 in the initial user namespace (its uid_map maps all
    ids to themselves)."""
    if os.geteuid() != 0:
        return False
    try:
        return Path("/proc/self/uid_map").read_text().split() == ["0", "0", "4294967295"]
    except OSError:
        return True  # (no user namespaces)


def _disk_row(cfg: Config, params: int, device_bytes: int, rank: int, per: float) -> tuple[int, int, int, int, str]:
    from capstan.chunkmem.memory.disk import chunk_file  # (chunkmem is imported where chunks are made)

    mem = cfg.memory
    assert mem.cpu_budget is not None
    where = _existing(mem.disk_dir)
    if not os.access(where, os.W_OK | os.X_OK):  # (else this rank alone would fail, making its chunk file)
        raise PermissionError(13, "this process may not write there", str(where))
    left = chunk_file(mem.disk_dir, rank)  # (emptied when the run's DiskStore opens it)
    held = left.stat().st_blocks * 512 if left.is_file() else 0  # (the blocks it holds: a file may be sparse)
    need = max(0, int(per * params) - mem.cpu_budget - device_bytes)
    what = (f"this rank: {params} parameters x {per:g} bytes kept all step, {human_bytes(per * params)}, "
            f"less memory.cpu_budget's {human_bytes(mem.cpu_budget)}"
            + (f" and the GPU's parameter chunks' {human_bytes(device_bytes)}" if device_bytes else ""))
    return _node_key("disk", os.stat(where).st_dev), need, _disk_free(where), held, what


def _ram_row(params: int, resident: int, per: float) -> tuple[int, int, int, int, str]:
    avail, source = available_ram(all_cache=True)
    if not avail and source == "MemAvailable":  # not Linux: unknown, never refused
        return _node_key("ram"), 0, 1 << 62, 0, ""
    swap = proc_kib(MEMINFO, "SwapFree") if source == "MemAvailable" else 0
    need = max(0, int(per * params) - resident)
    what = (f"this rank: {params} parameters x {per:g} bytes kept all step, {human_bytes(per * params)}"
            + (f", less {human_bytes(resident)} in RAM already" if resident else ""))
    source += " plus free swap" if swap else ""
    return _node_key("ram"), need, avail + swap, 0, what + f"; the RAM available: {source}"


def check_room_for_states(cfg: Config, groups: comm.Groups, params: int, resident: int = 0,
                          device_bytes: int = 0, *, sharded: bool = False, onebit_replicas: int = 0,
                          overlap: bool = False, overlap_error: str | None = None) -> None:
    """Refuse at start (one `ConfigError`, on every rank) a run whose model states cannot fit the room its
    nodes have (module docstring). `params`: the trainable parameters this rank keeps chunks of (its 1/dp
    under ZeRO-3: `sharded`; 1-bit Adam's replicated chunks over `onebit_replicas` ranks hold residuals
    too); `resident`: bytes of them already in RAM; `device_bytes`: what a GPU holds in their place
    (`device_param_bytes`); `overlap`: the optimizer overlaps backward (then past RAM it may drop the
    gradients: `drops_gradients`); `overlap_error`: this rank cannot overlap as asked. Collective over the
    world group: a rank that cannot read its disk or RAM says so in its row, so that every rank still meets
    the others there and raises."""
    mem, rank = cfg.memory, groups.world.rank
    own, kind, what, freed = overlap_error, BUDGET, "", 0
    per = persistent_bytes_per_param(cfg, sharded, drops_gradients(cfg, overlap, sharded), onebit_replicas)
    try:
        if own:
            key, need, room = rank, 1, 0
        elif mem.offload == "disk" and mem.cpu_budget is not None:
            (key, need, room, freed, what), kind = _disk_row(cfg, params, device_bytes, rank, per), DISK
        elif mem.offload == "cpu" and mem.cpu_budget is None:
            (key, need, room, freed, what), kind = _ram_row(params, resident, per), RAM
        else:  # a budget to check alone (room 0, a key of its own), or nothing to check
            budget = mem.cpu_budget
            own = (states_fit_error(budget, params, cfg, sharded, onebit_replicas)
                   if mem.offload == "cpu" and budget else None)
            key, need, room = rank, (1 if own else 0), 0
    except OSError as e:  # (an unreadable disk_dir, say)
        what = f"memory.disk_dir ({mem.disk_dir})" if mem.offload == "disk" else "RAM"
        own = f"cannot measure the room for the model states in {what}: {e}"
        kind, key, need, room = BUDGET, rank, 1, 0
    mine = torch.tensor([kind, key, need, room, freed], dtype=torch.int64)
    rows = torch.empty(5 * groups.world.size, dtype=torch.int64)
    comm.all_gather(rows, mine, group=groups.world)
    # (kind, node) -> [need, room, ranks]: the node's free space is one figure that every rank read (the
    # least), and the chunk files its ranks' last run left add to it (each emptied at open)
    nodes: dict[tuple[int, int], list[int]] = {}
    for k, key_, n, r, f in rows.view(-1, 5).tolist():
        total = nodes.setdefault((k, key_), [0, r, 0, 0])
        total[0] += n
        total[1] = min(total[1], r)
        total[2] += 1
        total[3] += f
    short = {k: n - (r + f) for k, (n, r, _, f) in nodes.items() if n > r + f}
    if not short:
        return
    if own:
        raise ConfigError(own)
    if (kind, key) in short:
        n, r, ranks, f = nodes[(kind, key)]
        if kind == DISK:
            where = f"memory.disk_dir ({mem.disk_dir}) has {human_bytes(r + f)} free" + (
                f" (with {human_bytes(f)} of chunk files a stopped run left there)" if f else "")
            fixes = ["free disk space", "set memory.disk_dir to a larger disk", "raise memory.cpu_budget"]
        else:
            where = f"the node has {human_bytes(r)}"
            fixes = ["use offload = \"disk\""]
        if cfg.precision.optimizer_states != "int8":
            fixes.append("take fewer bytes a parameter (precision.optimizer_states = \"int8\")")
        advice = ", ".join(fixes[:-1]) + (", or " if len(fixes) > 1 else "") + fixes[-1]
        raise ConfigError(
            f"memory.offload = \"{mem.offload}\": the model states of the {ranks} rank(s) on this node do not fit "
            f"its {'disk' if kind == DISK else 'RAM'}: they need at least {human_bytes(n)} of it ({what}), and "
            f"{where}: short by {human_bytes(short[(kind, key)])}. {advice[0].upper()}{advice[1:]}")
    (k, _), worst = max(short.items(), key=lambda item: item[1])
    if k == BUDGET:
        raise ConfigError("another rank cannot start: its memory.cpu_budget cannot hold its model states, it "
                          "could not measure its room, or it cannot overlap the optimizer as "
                          "memory.overlap_optimizer asks (that rank's error says which)")
    raise ConfigError(f"memory.offload = \"{mem.offload}\": the model states do not fit another node's "
                      f"{'disk' if k == DISK else 'RAM'}: short by {human_bytes(worst)} there (its ranks' error "
                      "names every number)")
