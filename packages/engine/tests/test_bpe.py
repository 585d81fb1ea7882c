"""data.tokenizer = "bpe": deterministic training, round trip, saved with the run, reused on resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="needs the tokenizers package (capstan-engine[bpe])")

from capstan.engine import cli  # noqa: E402
from capstan.engine.config.load import resolve  # noqa: E402
from capstan.engine.data import (  # noqa: E402
    bpe,  # noqa: E402
    open_data,
    stdlib_text,
)

VOCAB = 512
TEXT = stdlib_text(60_000)


def test_training_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    a, b = bpe.train_bpe(TEXT, VOCAB), bpe.train_bpe(TEXT, VOCAB)
    assert a.get_vocab_size() == VOCAB
    assert bpe.save_bpe(a, tmp_path / "a.json").read_bytes() == bpe.save_bpe(b, tmp_path / "b.json").read_bytes()
    ids = bpe.encode(a, TEXT)
    assert (ids == bpe.encode(b, TEXT)).all() and len(ids) < len(TEXT) * 0.7  # merges do compress
    assert int(ids.max()) < VOCAB
    for text in (TEXT.decode(), "héllo wörld ✓ 日本語\n\ttabs  and  spaces\n", ""):
        assert bpe.decode(a, bpe.encode(a, text.encode())) == text
    reloaded = bpe.load_bpe(tmp_path / "a.json")
    assert (bpe.encode(reloaded, TEXT) == ids).all()


def _argv(run_dir: Path, *extra: str) -> list[str]:
    sets = {"model.n_layers": "1", "model.n_heads": "2", "model.d_model": "32", "model.seq_len": "32",
            "model.vocab_size": str(VOCAB), "data.tokenizer": '"bpe"', "data.max_bytes": "60000",
            "train.steps": "12", "train.micro_batch_size": "8", "train.lr": "0.01", "train.warmup_steps": "1",
            "train.lr_schedule": '"constant"',
            "log.run_dir": str(run_dir), "log.every": "100"}
    out = ["train", "--config", str(run_dir.parent / "empty.toml")]
    for k, v in sets.items():
        out += ["--set", f"{k}={v}"]
    for e in extra:
        out += ["--set", e]
    return out


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


def test_cli_trains_saves_and_reuses_the_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "empty.toml").write_text("")
    run = tmp_path / "run"
    assert cli.main(_argv(run, "checkpoint.every=6")) == 0
    saved = run / "tokenizer.json"
    assert saved.is_file()
    losses = _losses(run)
    assert abs(losses[0] - math.log(VOCAB)) < 0.5, losses[0]  # starts near uniform over the vocabulary
    assert losses[-1] < losses[0] - 0.5, losses

    # Resume reuses the saved tokenizer: with less text, retraining would learn different merges.
    before = saved.read_bytes()
    assert bpe.train_bpe(TEXT[:40_000], VOCAB).to_str(pretty=True).encode() != before
    assert cli.main(_argv(run, "checkpoint.every=6", "checkpoint.resume=true", "train.steps=14",
                          "data.max_bytes=40000")) == 0
    assert saved.read_bytes() == before and len(_losses(run)) == 14

    # tokenizer_file: another run loads this one's ids instead of training; it is copied there.
    cfg, _ = resolve({"model": {"seq_len": 32, "vocab_size": 1024}, "log": {"run_dir": str(tmp_path / "other")},
                      "data": {"tokenizer": "bpe", "max_bytes": 60000, "tokenizer_file": str(saved)}})
    a = open_data(cfg)
    cfg2, _ = resolve({"model": {"seq_len": 32, "vocab_size": VOCAB}, "log": {"run_dir": str(run)},
                       "checkpoint": {"resume": True}, "data": {"tokenizer": "bpe", "max_bytes": 60000}})
    assert (a.tokens == open_data(cfg2).tokens).all()
    assert (tmp_path / "other" / "tokenizer.json").is_file()
