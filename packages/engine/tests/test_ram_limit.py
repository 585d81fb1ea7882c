"""`memory.ram_limit`: after the warm-up step the chunks get the limit minus the measured activations."""

from __future__ import annotations

from pathlib import Path

import pytest

from capstan.engine import initialize, open_data, train_batches


def _losses(cfg: dict, steps: int = 4) -> tuple[list[float], object]:
    engine = initialize(config=cfg)
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    losses = [engine.train_batch(it).loss for _ in range(steps)]
    engine.close()
    return losses, engine


def test_ram_limit_lets_chunks_grow_past_the_warmup_budget(tmp_path: Path) -> None:
    # Activations of at least 128 KiB (logits 8 x 64 x 256 fp32 = 512 KiB): the manager makes glibc
    # serve those with fresh mmap pages, so RSS grows with them even in a process whose heap is full
    # of free small blocks from earlier tests (with only small tensors the step reused those
    # blocks, RSS did not move, and the measured activations were 0 in one full-suite run).
    base = {"model": {"n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 64}, "data": {"max_bytes": 100_000},
            "train": {"micro_batch_size": 8, "lr": 1e-2, "warmup_steps": 1, "steps": 4}}
    plain, _ = _losses(base)
    limited = {**base, "memory": {"offload": "disk", "chunk_size": 8192, "cpu_budget": 300_000,
                                  "ram_limit": 256 << 20, "disk_dir": str(tmp_path)}}
    got, engine = _losses(limited)
    assert got == pytest.approx(plain, rel=1e-5)
    stats = engine.manager.stats()
    assert stats["chunk_capacity_bytes"] > 300_000  # the warm-up budget was only the start
    assert stats["nonmodel_peak_bytes"] > 0  # the activations were measured
