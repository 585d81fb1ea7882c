"""With chunked memory the reference GPT is built straight into chunks: never whole in RAM.

Each case runs `initialize` in a fresh process and reads its peak RSS (`VmHWM`, reset to the current RSS just
before through /proc/self/clear_refs; `ru_maxrss` would not do: a child inherits its parent's RSS at fork as
its starting peak) against the RSS just before: a 253 MB (fp32, 63M parameters) model under a 32 MiB chunk
budget with the disk tier must raise the peak by far less than its size, while the same model built eagerly
and then chunked (a builder function returning the real module) raises it by more than its size. Trajectories
of the meta-built model equal the eager one's: test_training.py's offload tests compare them with no offload.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from capstan.engine import initialize, open_data, train_batches

SCRIPT = r"""
import json, re, sys
import torch
torch.set_num_threads(1)
from capstan.engine import initialize
from capstan.engine.model.models import build_reference_model
eager = sys.argv[1] == "eager"
config = {"model": {"n_layers": 20, "n_heads": 8, "d_model": 512, "seq_len": 64},
          "memory": {"offload": "disk", "chunk_size": 1 << 20, "cpu_budget": 32 << 20, "disk_dir": sys.argv[2]},
          "train": {"micro_batch_size": 1}}
# The fixed costs first (libraries loaded, the disk tier's threads, allocator pools): a tiny model.
tiny = dict(config, model={"n_layers": 1, "n_heads": 8, "d_model": 64, "seq_len": 64})
initialize(model=build_reference_model if eager else None, config=tiny).close()
def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
before = status("VmRSS")
engine = initialize(model=build_reference_model if eager else None, config=config)
peak = status("VmHWM")
params = sum(c.used for lst in engine.module.chunks[engine.module.kinds()[0]] for c in lst)
x = torch.randint(0, 256, (1, 64))
engine.backward(engine((x, x)))
engine.step()
engine.close()
print(json.dumps({"rise": peak - before, "params": params}))
"""


def _start(mode: str, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(tmp_path / mode)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rise(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_the_reference_gpt_is_built_layer_by_layer_into_chunks(tmp_path: Path) -> None:
    runs = [_start("meta", tmp_path), _start("eager", tmp_path)]  # at once, one thread each: their own RSS
    meta, eager = (_rise(p) for p in runs)
    model_bytes = 4 * meta["params"]
    assert meta["params"] == eager["params"] > 60_000_000
    assert eager["rise"] > model_bytes, eager  # the whole model existed in RAM before it was chunked
    # The 32 MiB of chunks, one block (12.6 MB) at a time and its full-size initial values: 75 MB
    # measured, against 359-375 MB eagerly.
    assert meta["rise"] < 0.4 * model_bytes, (meta, model_bytes)


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.out = nn.Embedding(256, 32), nn.Linear(32, 64), nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(self.emb(x))))


def _meta_lm(cfg, groups) -> nn.Module:
    with torch.device("meta"):
        return _LM()


def _losses(model, offload: str) -> list[float]:
    engine = initialize(model=model, config={
        "model": {"seq_len": 16}, "data": {"max_bytes": 100_000}, "precision": {"dtype": "fp32"},
        "train": {"steps": 5, "micro_batch_size": 2, "lr": 1e-2}, "memory": {"offload": offload}})
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    out = [engine.train_batch(it).loss for _ in range(5)]
    engine.close()
    return out


def test_a_builder_may_return_a_meta_model_for_chunked_memory_only() -> None:
    # reset_parameters() in module order draws what eager construction drew: the same training.
    assert _losses(_meta_lm, "cpu") == _losses(lambda cfg, groups: _LM(), "cpu")
    with pytest.raises(ValueError, match="on the meta device .* only chunked memory materializes them"):
        _losses(_meta_lm, "none")


def test_a_layer_spec_list_is_built_straight_into_chunks_like_the_eager_list(monkeypatch) -> None:
    from capstan.engine.config import Config
    from capstan.engine.model import models as build
    from capstan.pipeline import LayerSpec, build_layers

    specs = [LayerSpec(lambda: nn.Embedding(256, 32), "emb"),
             *(LayerSpec(lambda: nn.Sequential(nn.Linear(32, 32), nn.Tanh()), f"block{i}") for i in range(2)),
             LayerSpec(lambda: nn.Linear(32, 256), "head")]
    eager = nn.Sequential(*build_layers(specs, range(len(specs)), seed=Config().train.seed))
    calls = []
    init = build.LayerwiseInit.__call__
    monkeypatch.setattr(build.LayerwiseInit, "__call__", lambda self, m: (calls.append(m), init(self, m)))
    assert _losses(specs, "cpu") == _losses(eager, "cpu")
    assert len(calls) == 4  # each module holding parameters took its values from its layer's factory
