"""`memory.chunk_order = "trace"`: a user module built in another order than it runs.

Packed in creation order, each chunk holds layers that run far apart, so under
a RAM budget with the disk tier each chunk comes back several times per step;
packed in the order a forward on a dummy batch first calls the modules, a
step sweeps the chunks in order. The losses are the same either way (fp32;
only the gradient norm's summation order differs).
"""

from __future__ import annotations

import torch
from torch import nn

from capstan.engine import initialize, open_data, train_batches
from capstan.engine.config.load import ConfigError

D, LAYERS, VOCAB = 64, 12, 256
BUILD = [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]  # creation order of layer i (run in order 0..11)
CHUNK = 4 * (D * D + D) + 256  # four blocks per chunk (the embedding and head fit one chunk each)
STEPS = 4


class Shuffled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D, VOCAB)
        for i in BUILD:
            self.add_module(f"l{i}", nn.Linear(D, D))
        self.wte = nn.Embedding(VOCAB, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x)
        for i in range(LAYERS):
            h = torch.tanh(getattr(self, f"l{i}")(h))
        return self.head(h)


def _run(order: str, tmp: str) -> tuple[list[float], float]:
    torch.manual_seed(0)
    cfg = {"model": {"seq_len": 16}, "data": {"max_bytes": 100_000},
           "train": {"steps": STEPS, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 0},
           "memory": {"offload": "disk", "chunk_size": CHUNK, "cpu_budget": 5 * CHUNK * 4,
                      "disk_dir": tmp, "chunk_order": order}}
    engine = initialize(model=Shuffled(), config=cfg)
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    infos = [engine.train_batch(it) for _ in range(STEPS)]
    engine.close()
    return [i.loss for i in infos], infos[-1].mem["mem.moved_bytes"]


def test_traced_order_moves_fewer_bytes_and_trains_the_same(tmp_path) -> None:
    modules, moved_modules = _run("modules", str(tmp_path / "m"))
    trace, moved_trace = _run("trace", str(tmp_path / "t"))
    assert max(abs(a - b) / abs(b) for a, b in zip(trace, modules)) <= 1e-6, (trace, modules)
    assert modules[-1] < modules[0]
    assert 0 < moved_trace < moved_modules, (moved_trace, moved_modules)


def test_trace_order_needs_chunks_and_one_stage() -> None:
    import pytest

    with pytest.raises(ConfigError, match="chunk_order"):
        initialize(model=Shuffled(), config={"memory": {"chunk_order": "trace"}})


def _reference_losses(order: str) -> list[float]:
    cfg = {"model": {"n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16, "dropout": 0.1},
           "data": {"max_bytes": 100_000}, "precision": {"dtype": "fp32"},
           "train": {"steps": STEPS, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 0},
           "memory": {"offload": "cpu", "chunk_order": order}}
    engine = initialize(config=cfg)
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    losses = [engine.train_batch(it).loss for _ in range(STEPS)]
    engine.close()
    return losses


def test_the_reference_gpt_traces_on_the_meta_device_and_trains_the_same() -> None:
    # With chunked memory the reference GPT is built on the meta device (build.py), so the traced
    # forward runs there too: shapes only, no dropout draws, the same training as creation order.
    assert _reference_losses("trace") == _reference_losses("modules")
