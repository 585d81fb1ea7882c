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
from capstan.engine.config.load import ConfigError
from capstan.engine.machine import room

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


def test_a_model_built_in_ram_counts_the_parameters_it_holds_already(monkeypatch: pytest.MonkeyPatch) -> None:
    """offload cpu without a budget: a model built in RAM (Hugging Face's from_pretrained, a module of one's
    own) gives its tensors up to the chunks, so the RAM it holds already counts as room. fp32: 12 B a
    parameter kept all step, 4 of them held already: RAM for 10 B a parameter fits; for 6 B it does not."""
    _no_swap(monkeypatch)
    model = TokensToLogits()
    params = sum(p.numel() for p in model.parameters())
    cfg = {**SMALL_GPT, "memory": {"offload": "cpu"}}
    monkeypatch.setattr(room, "available_ram", lambda: (10 * params, "MemAvailable"))
    initialize(model=model, config=cfg).close()
    monkeypatch.setattr(room, "available_ram", lambda: (6 * params, "MemAvailable"))
    with pytest.raises(ConfigError, match=r"do not fit its RAM: they need at least .* less 129.0 KiB in RAM already"):
        initialize(model=TokensToLogits(), config=cfg)
    monkeypatch.setattr(room, "available_ram", lambda: (0, "MemAvailable"))  # not Linux: unknown, not refused
    initialize(model=TokensToLogits(), config=cfg).close()
    # a memory cgroup at its limit is no room at all, not "unknown"
    monkeypatch.setattr(room, "available_ram", lambda: (0, "the memory cgroup's limit less its working set"))
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
