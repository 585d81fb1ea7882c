"""States against the machine's room at start (machine/room.py): what counts as room, so that nothing that
fits is refused. The refusals themselves: test_config_errors.py (one process, a 257B-parameter GPT on
the meta device) and test_training.py (two ranks, one node and two, in the layouts' launch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from capstan.engine import initialize
from capstan.engine.config import load_config
from capstan.engine.config.load import ConfigError, drops_gradients, persistent_bytes_per_param
from capstan.engine.machine import ram_budget, room

SMALL_GPT = {"model": {"n_layers": 1, "n_heads": 4, "d_model": 128, "seq_len": 16}, "data": {"max_bytes": 100_000},
             "train": {"steps": 2, "micro_batch_size": 2, "warmup_steps": 1}, "precision": {"dtype": "fp32"}}


class TokensToLogits(nn.Module):
    """A model of one's own, built in RAM before the engine chunks it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        self.head = nn.Linear(64, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def _no_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(room, "proc_kib", lambda path, key: 0)


def _ram(monkeypatch: pytest.MonkeyPatch, nbytes: int, source: str = "MemAvailable") -> None:
    monkeypatch.setattr(room, "available_ram", lambda all_cache=False: (nbytes, source))


def test_a_model_built_in_ram_counts_the_parameters_it_holds_already(monkeypatch: pytest.MonkeyPatch) -> None:
    """offload cpu without a budget: a model built in RAM (Hugging Face's from_pretrained, a module of one's
    own) gives its tensors up to the chunks, so the RAM it holds already counts as room. fp32: 16 B a
    parameter kept all step (nothing streams, so every gradient chunk stays to the step's end), 4 of them
    held already: RAM for 13 B a parameter fits; for 11 B it does not."""
    _no_swap(monkeypatch)
    model = TokensToLogits()
    params = sum(p.numel() for p in model.parameters())
    cfg = {**SMALL_GPT, "memory": {"offload": "cpu"}}
    _ram(monkeypatch, 13 * params)
    initialize(model=model, config=cfg).close()
    _ram(monkeypatch, 11 * params)
    with pytest.raises(ConfigError, match=r"do not fit its RAM: they need at least .* less 129.0 KiB in RAM already"):
        initialize(model=TokensToLogits(), config=cfg)
    _ram(monkeypatch, 0)  # not Linux: unknown, not refused
    initialize(model=TokensToLogits(), config=cfg).close()
    # a memory cgroup at its limit is no room at all, not "unknown"
    _ram(monkeypatch, 0, "the memory cgroup's limit less its usage but page cache")
    with pytest.raises(ConfigError, match="the node has 0 B: short by"):
        initialize(model=TokensToLogits(), config=cfg)


def test_a_chunk_file_a_stopped_run_left_counts_as_room(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """offload disk: the chunk file a killed run left in memory.disk_dir is emptied when the new run opens it,
    so the blocks it holds count as free: with no other free space the states fit in those of such a file,
    and not beside a sparse one that holds none."""
    cfg = {**SMALL_GPT, "model": {**SMALL_GPT["model"], "n_layers": 3},
           "memory": {"offload": "disk", "chunk_size": 65536, "cpu_budget": 16 * 65536 * 4,
                      "disk_dir": str(tmp_path / "chunks")}}
    monkeypatch.setattr(room, "_disk_free", lambda where: 0)
    with pytest.raises(ConfigError, match=r"memory.disk_dir \(.*chunks\) has 0 B free: short by"):
        initialize(config=cfg)
    (tmp_path / "chunks").mkdir()
    with open(tmp_path / "chunks" / "capstan-chunks-rank0.bin", "wb") as f:
        f.truncate(64 << 20)  # sparse: it holds no blocks, so it frees none
    with pytest.raises(ConfigError, match="has 0 B free: short by"):
        initialize(config=cfg)
    (tmp_path / "chunks" / "capstan-chunks-rank0.bin").write_bytes(os.urandom(8 << 20))  # what a killed run wrote
    initialize(config=cfg).close()


def test_a_disk_that_cannot_be_measured_is_one_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An OSError while measuring the room (an unreadable disk_dir) is that rank's error row, not an exception
    before the collective that the other ranks would wait in: every rank raises (here the one)."""
    def unreadable(where: Path) -> int:
        raise PermissionError(13, "Permission denied", str(where))

    monkeypatch.setattr(room, "_disk_free", unreadable)
    cfg = {**SMALL_GPT, "memory": {"offload": "disk", "chunk_size": 65536, "cpu_budget": 16 * 65536 * 4,
                                   "disk_dir": str(tmp_path / "chunks")}}
    with pytest.raises(ConfigError, match=r"cannot measure the room for the model states in memory.disk_dir "
                                          r"\(.*chunks\): \[Errno 13\] Permission denied"):
        initialize(config=cfg)


@pytest.mark.parametrize(("dtype", "sections", "sharded", "overlap", "per", "onebit"), [
    # fp32 compute: parameter (the master) 4, gradient 4, moments 4 + 4
    ("fp32", {"memory": {"offload": "cpu"}}, False, True, 16, 0),  # in RAM nothing streams: gradients kept
    ("fp32", {"memory": {"offload": "disk", "cpu_budget": 1 << 30}, "train": {"grad_clip": 0.0}}, False, True, 12, 0),
    ("fp32", {"memory": {"offload": "disk", "cpu_budget": 1 << 30}, "train": {"grad_clip": 0.0}}, False, False, 16, 0),
    ("fp32", {"memory": {"offload": "disk", "cpu_budget": 1 << 30}}, False, True, 16, 0),  # clipping: kept to the end
    ("fp32", {"memory": {"offload": "disk", "cpu_budget": 1 << 30}, "train": {"grad_clip": 0.0, "grad_accum_steps": 2}},
     False, True, 16, 0),  # accumulation: every gradient chunk lives across the micro-batches
    ("fp32", {"memory": {"offload": "disk", "cpu_budget": 1 << 30}, "train": {"grad_clip": 0.0}}, True, False, 16, 0),
    # bf16 compute, fp32 master: 2 + 4 + moments 8, the gradient in the 16-bit slot, or fp32 chunks of its own
    ("bf16", {"memory": {"offload": "cpu"}}, False, True, 14, 0),
    ("bf16", {"memory": {"offload": "cpu"}, "train": {"grad_accum_steps": 2}}, False, True, 18, 0),
    ("bf16", {"memory": {"offload": "cpu"}}, True, False, 18, 0),  # ZeRO-3 reduces into fp32 gradient chunks
    # a bf16 master: 2 + a bf16 gradient 2 + moments 8 (fp32 under ZeRO-3)
    ("bf16", {"memory": {"offload": "cpu"}, "precision": {"master_weights": "bf16"}}, False, True, 12, 0),
    ("bf16", {"memory": {"offload": "disk", "cpu_budget": 1 << 30}, "train": {"grad_clip": 0.0},
              "precision": {"master_weights": "bf16"}}, False, True, 10, 0),
    ("bf16", {"memory": {"offload": "cpu"}, "precision": {"master_weights": "bf16"}}, True, False, 14, 0),
    # 8-bit moments: a code and a quarter of a scale's 4 B per 256 values each
    ("fp32", {"memory": {"offload": "disk", "cpu_budget": 1 << 30}, "train": {"grad_clip": 0.0},
              "precision": {"optimizer_states": "int8"}}, False, True, 4 + 2 * (1 + 4 / 256), 0),
    # 1-bit Adam over 2 replicas: fp32 gradient chunks, and the worker's and the server's residuals (4 + 4/2)
    ("bf16", {"memory": {"offload": "cpu"}}, False, False, 2 + 4 + 4 + 8 + 4 + 2, 2),
    ("fp32", {"memory": {"offload": "disk", "cpu_budget": 1 << 30}, "train": {"grad_clip": 0.0}}, False, False,
     4 + 4 + 8 + 4 + 2, 2),
])
def test_the_room_counts_gradients_wherever_the_step_keeps_them(dtype: str, sections: dict, sharded: bool,
                                                                overlap: bool, per: float, onebit: int) -> None:
    """The bytes a parameter keeps all step: its gradient too, but where the overlapped optimizer past RAM
    consumes and drops it in backward (neither clipping nor loss scaling, one backward a step, no ZeRO-3).
    Counting it nowhere let through runs that fill the disk, or RAM, in their first step. (`onebit`: 1-bit
    Adam's replicated chunks over that many replicas.)"""
    overrides = [f"precision.dtype=\"{dtype}\""] + [
        f"{name}.{key}={value!r}".replace("'", '"') for name, body in sections.items() for key, value in body.items()]
    cfg = load_config(overrides=overrides)
    got = persistent_bytes_per_param(cfg, sharded, drops_gradients(cfg, overlap, sharded), onebit)
    assert got == pytest.approx(per)


def test_one_ranks_budget_is_checked_against_its_share_not_the_whole_model() -> None:
    """offload cpu with a budget: the config check holds one rank's budget against the whole reference GPT
    only where one rank holds it all; under dp (ZeRO-3), tp, pp or cp each rank's share is counted once the
    model exists (the 2-rank refusal: test_training.py). Before, a budget that held a rank's share but not
    the whole model was refused at load."""
    base = ["memory.offload=\"cpu\"", "model.n_layers=4", "model.d_model=256"]
    whole = load_config(overrides=base)
    from capstan.engine.config.load import reference_param_count, state_bytes_per_param

    budget = int(0.7 * state_bytes_per_param(whole) * reference_param_count(whole))
    for one in ("parallel.dp=1", "parallel.dp=0"):  # (0: the world's size, 1 in this process)
        with pytest.raises(ConfigError, match="keeps every chunk in RAM: memory.cpu_budget"):
            load_config(overrides=base + [f"memory.cpu_budget={budget}", one])
    for axis in ("parallel.dp=2", "parallel.tp=2", "parallel.pp=2"):
        load_config(overrides=base + [f"memory.cpu_budget={budget}", axis])


def test_a_cgroups_page_cache_counts_as_room_for_the_refusal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A memory cgroup's room for the refusal at start is its limit less its usage but all its page cache
    (the kernel reclaims active file pages too before it kills); the budget's cautious figure keeps the
    active cache as used. Here 8 GiB limit, 7 GiB used of which 3 GiB active and 1 GiB inactive cache."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(str(8 << 30))
    (root / "memory.current").write_text(str(7 << 30))
    (root / "memory.stat").write_text(f"anon {3 << 30}\nactive_file {3 << 30}\ninactive_file {1 << 30}\n")
    (tmp_path / "self-cgroup").write_text("0::/\n")
    monkeypatch.setattr(ram_budget, "CGROUP_ROOT", root)
    monkeypatch.setattr(ram_budget, "PROC_CGROUP", str(tmp_path / "self-cgroup"))
    assert ram_budget.cgroup_room() == 2 << 30
    assert ram_budget.cgroup_room(all_cache=True) == 5 << 30


def test_a_disk_dir_this_process_cannot_write_is_one_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A memory.disk_dir the process may not write is its rank's error row in the collective, not a
    failure of that rank alone when it makes its chunk file (its peers would wait in their next collective)."""
    real = os.access
    monkeypatch.setattr(room.os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real(path, mode))
    cfg = {**SMALL_GPT, "memory": {"offload": "disk", "chunk_size": 65536, "cpu_budget": 16 * 65536 * 4,
                                   "disk_dir": str(tmp_path / "chunks")}}
    with pytest.raises(ConfigError, match=r"memory.disk_dir \(.*chunks\): \[Errno 13\] this process may not write"):
        initialize(config=cfg)
    assert not (tmp_path / "chunks").exists()
