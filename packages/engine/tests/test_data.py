"""Every kind of `data.source` reads the tokens it should: a text file, a folder, uint16/uint32 `.bin` files.

The default corpus (the standard library) is covered by test_training.py; bad sources by
test_config_errors.py. Here each source is built by the test, so the expected token stream is known
exactly, and one short training run goes through the command line on a `.bin` file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from capstan.engine.config.load import load_config
from capstan.engine.data import micro_batch, open_data, val_batches

SEQ = 16


def _cfg(source: Path, *extra: str, vocab: int = 256):
    return load_config({"model": {"n_layers": 1, "n_heads": 2, "d_model": 16, "seq_len": SEQ, "vocab_size": vocab},
                        "data": {"source": str(source), "max_bytes": 4096, "val_fraction": 0.25}}, extra)


def _assert_windows_follow_the_stream(data, cfg) -> None:
    x, y = micro_batch(data, cfg, dp=1, step=3, accum_index=0, dp_rank=0)
    tokens = np.asarray(data.tokens, dtype=np.int64)
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        starts = [i for i in range(data.n_train - SEQ) if np.array_equal(tokens[i:i + SEQ], row_x)]
        assert starts, "a training window that is not in the training part of the stream"
        assert any(np.array_equal(tokens[s + 1:s + SEQ + 1], row_y) for s in starts)  # targets: shifted by one
    for vx, _ in val_batches(data, cfg, dp=1, dp_rank=0):
        assert vx.numel() > 0


def test_a_text_file_is_its_bytes_split_into_train_and_validation(tmp_path: Path) -> None:
    text = bytes(range(32, 127)) * 20  # 1900 bytes
    (tmp_path / "corpus.txt").write_bytes(text)
    cfg = _cfg(tmp_path / "corpus.txt")
    data = open_data(cfg)
    assert bytes(np.asarray(data.tokens)) == text
    assert (data.n_train, data.n_val) == (1900 - 475, 475)
    _assert_windows_follow_the_stream(data, cfg)


def test_max_bytes_caps_the_text(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_bytes(b"abcdefgh" * 1000)
    data = open_data(_cfg(tmp_path / "corpus.txt"))
    assert len(data.tokens) == 4096


def test_a_folder_is_its_files_in_sorted_order_without_hidden_ones(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "a.txt").write_bytes(b"A" * 300)
    (tmp_path / "b" / "c.txt").write_bytes(b"C" * 300)
    (tmp_path / "b" / ".hidden").write_bytes(b"H" * 300)
    (tmp_path / ".git" / "config").write_bytes(b"G" * 300)
    (tmp_path / "z.md").write_bytes(b"Z" * 300)
    data = open_data(_cfg(tmp_path))
    assert bytes(np.asarray(data.tokens)) == b"\n".join([b"A" * 300, b"C" * 300, b"Z" * 300])


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_bin_file_is_memory_mapped_with_its_dtype(tmp_path: Path, dtype: str) -> None:
    vocab = 50_000 if dtype == "uint16" else 100_000  # ids above 65535 need uint32
    ids = (np.arange(2000, dtype=np.int64) * 7919 % vocab).astype(dtype)
    ids.tofile(tmp_path / "tokens.bin")
    cfg = _cfg(tmp_path / "tokens.bin", f"data.bin_dtype=\"{dtype}\"", vocab=vocab)
    data = open_data(cfg)
    assert isinstance(data.tokens, np.memmap) and data.tokens.dtype == np.dtype(dtype)
    assert np.array_equal(np.asarray(data.tokens), ids)
    assert (data.n_train, data.n_val) == (1500, 500)
    _assert_windows_follow_the_stream(data, cfg)


def test_training_from_a_bin_file_on_the_command_line(tmp_path: Path) -> None:
    from capstan.engine.cli import main

    rng = np.random.default_rng(0)
    # A learnable stream: each id is followed by (3 * id + 1) mod 1000.
    ids = [int(rng.integers(0, 1000))]
    for _ in range(20_000):
        ids.append((3 * ids[-1] + 1) % 1000 if rng.random() < 0.9 else int(rng.integers(0, 1000)))
    np.asarray(ids, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    run = tmp_path / "run"
    tiny = Path(__file__).resolve().parents[3] / "examples" / "tiny.toml"
    argv = ["train", "--config", str(tiny), "--set", f"data.source=\"{tmp_path / 'tokens.bin'}\"",
            "--set", "model.vocab_size=1000",
            "--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.n_heads=2",
            "--set", "model.seq_len=32", "--set", "train.steps=30", "--set", "train.lr=1e-2",
            "--set", "train.warmup_steps=2", "--set", "train.eval_every=0", "--set", f"log.run_dir=\"{run}\""]
    assert main(argv) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30
    assert losses[0] == pytest.approx(np.log(1000), rel=0.1)  # starts at chance over 1000 ids
    assert losses[-1] < losses[0] - 1.0  # and learns the stream
