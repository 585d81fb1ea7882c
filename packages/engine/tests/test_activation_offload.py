"""memory.activation_offload: recomputed blocks' inputs wait on disk, training is unchanged, RSS drops.

Two single-process runs of the reference GPT with recomputed blocks (8 layers, a 2048-token sequence,
block inputs of 2 MiB each), one keeping the inputs in RAM and one offloading them to disk, each in a
fresh interpreter so their peak RSS (VmHWM) is their own. glibc is told to serve every allocation over
128 KiB with its own pages (MALLOC_MMAP_THRESHOLD_), so freed tensors leave RSS at once and the peak
follows what is held. The losses are identical, and the peak drops by the offloaded bytes less the two
inputs in RAM at backward's start (the block being recomputed and the one read ahead of it). The memory
report counts the inputs in both runs. Multi-process layouts with offload are in test_context_parallel.py
(cp 2, pp 2 x cp 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capstan.engine import ConfigError
from capstan.engine.config import resolve

LAYERS, SEQ, D = 8, 2048, 256
INPUT = SEQ * D * 4  # one block's input, fp32

_RUN = """
import json, sys, torch
from capstan.engine import initialize, open_data, train_batches
torch.set_num_threads(1)
cfg = {"model": {"n_layers": %d, "n_heads": 4, "d_model": %d, "seq_len": %d, "vocab_size": 256},
       "data": {"max_bytes": 100_000}, "train": {"micro_batch_size": 1, "lr": 1e-3, "warmup_steps": 1, "steps": 2},
       "memory": {"activation_checkpointing": True, "activation_offload": sys.argv[1] == "1", "disk_dir": sys.argv[2]}}
engine = initialize(config=cfg)
it = train_batches(open_data(engine.config), engine.config, 1, 0)
infos = [engine.train_batch(it) for _ in range(2)]
engine.close()
print(json.dumps({"loss": [i.loss for i in infos], "mem": infos[-1].mem}))
""" % (LAYERS, D, SEQ)  # noqa: UP031 (a code template: its dicts' braces would need doubling for str.format)


def _start(offload: bool, disk: Path) -> subprocess.Popen:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    return subprocess.Popen([sys.executable, "-c", _RUN, "1" if offload else "0", str(disk)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_offloaded_inputs_train_the_same_with_less_rss(tmp_path: Path) -> None:
    # Both at once, one thread each (each process's own peak RSS is what is compared).
    runs = [_start(False, tmp_path / "kept"), _start(True, tmp_path / "moved")]
    kept, moved = (_result(p) for p in runs)
    assert moved["loss"] == kept["loss"]  # bit for bit: the values come back as they left
    assert kept["mem"]["mem.act.block_inputs_peak_bytes"] == LAYERS * INPUT
    assert kept["mem"]["mem.act.offloaded_peak_bytes"] == 0
    assert moved["mem"]["mem.act.offloaded_peak_bytes"] == LAYERS * INPUT
    assert moved["mem"]["mem.act.offloaded_total_bytes"] == 2 * LAYERS * INPUT  # both steps
    assert moved["mem"]["mem.act.block_inputs_peak_bytes"] == 0
    saved = kept["mem"]["mem.process.rss_peak_bytes"] - moved["mem"]["mem.process.rss_peak_bytes"]
    expected = (LAYERS - 2) * INPUT
    assert saved >= 0.9 * expected, (saved, expected)
    assert not list(tmp_path.rglob("*.bin"))  # the disk tier's file is removed at close


def test_offload_needs_recomputed_reference_blocks() -> None:
    with pytest.raises(ConfigError, match="memory.activation_offload moves the inputs of recomputed blocks: it "
                                          "needs memory.activation_checkpointing = true"):
        resolve(None, ["memory.activation_offload=true"])
    with pytest.raises(ConfigError, match="memory.activation_offload"):
        resolve(None, ["memory.activation_offload=true", "memory.activation_checkpointing=true"],
                reference_model=False)
