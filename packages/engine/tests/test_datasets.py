"""Datasets of one's own (data/datasets.py) and JSON Lines sources: batches that do not depend on the
layout, resume at a step, and train through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from capstan.engine import DataError, dataset_batches, initialize, open_data
from capstan.engine.config import ConfigError, resolve

SEQ = 16


class Tokens(torch.utils.data.Dataset):
    """A map-style dataset of token sequences (seq_len + 1 ids each)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.rows = torch.randint(0, 256, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


def _cfg(dp: int, accum: int) -> object:
    return resolve({"model": {"n_layers": 1, "d_model": 32, "n_heads": 4, "seq_len": SEQ},
                    "train": {"micro_batch_size": 2, "grad_accum_steps": accum, "steps": 4}})[0]


def _steps(make: object, dp: int, accum: int, steps: int, start: int = 0, **kw: object) -> list:
    """Every micro-batch of `steps` steps: [step][micro-batch k of the global batch]; `make()` gives each
    rank its dataset (an iterable is read by every rank from its start)."""
    cfg = _cfg(dp, accum)
    its = [dataset_batches(make(), cfg, dp, r, start_step=start, **kw) for r in range(dp)]
    out = []
    for _ in range(steps):
        per = {(a, r): next(its[r]) for a in range(accum) for r in range(dp)}
        out.append([per[(a, r)] for a in range(accum) for r in range(dp)])  # global order (a*dp + r)
    return out


def _same(a: list, b: list) -> bool:
    flat = lambda xs: [t for step in xs for mb in step for t in (mb if isinstance(mb, tuple) else mb.values())]  # noqa: E731
    return all(torch.equal(x, y) for x, y in zip(flat(a), flat(b), strict=True))


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_batches_are_the_same_under_any_layout_and_after_resume(kind: str) -> None:
    ds = Tokens(37 if kind == "map" else 48)  # map: not a multiple of the global batch (8), epochs wrap
    make = (lambda: ds) if kind == "map" else (lambda: iter(ds.rows))
    one = _steps(make, 1, 4, 6)
    four = _steps(make, 4, 1, 6)
    assert _same(one, four)
    x, y = one[0][0]
    assert x.shape == (2, SEQ) and torch.equal(x[:, 1:], y[:, :-1])  # targets shifted by one
    assert _same(_steps(make, 2, 2, 3, start=3), one[3:])  # resumed at step 3
    if kind == "map":  # a new permutation per epoch, and in order without shuffling
        assert not _same(one[:1], one[4:5])
        ordered = _steps(make, 1, 1, 1, shuffle=False)[0][0][0]
        assert torch.equal(ordered, ds.rows[:2, :-1])
    else:  # in the iterable's own order
        assert torch.equal(one[0][0][0], ds.rows[:2, :-1])


def test_an_exhausted_iterable_ends_and_an_empty_dataset_is_named() -> None:
    cfg = _cfg(1, 1)
    assert len(list(dataset_batches(iter(Tokens(5).rows), cfg, 1, 0))) == 2  # 2 whole steps of 2; the rest dropped
    with pytest.raises(DataError, match="the dataset is empty"):
        next(dataset_batches([], cfg, 1, 0))
    with pytest.raises(DataError, match="ended after 5 samples, before step 3"):
        next(dataset_batches(iter(Tokens(5).rows), cfg, 1, 0, start_step=3))


def test_a_dataset_trains_through_the_engine_with_dict_samples() -> None:
    class Dicts(Tokens):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.rows[i, :-1], "labels": self.rows[i, 1:]}

    class Model(torch.nn.Module):  # returns a dict with the loss when given labels, as HF models do
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256)

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            logits = self.out(self.emb(x))
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1))
            return {"logits": logits, "loss": loss}

    torch.manual_seed(0)
    engine = initialize(model=Model(), config={"train": {"micro_batch_size": 4, "steps": 20, "lr": 1e-2},
                                               "model": {"seq_len": SEQ}})
    it = dataset_batches(Dicts(8), engine.config, 1, 0)
    losses = [engine.train_batch(it).loss for _ in range(20)]
    engine.close()
    assert losses[-1] < losses[0] - 1.0  # memorizes 8 sequences


def test_jsonl_source(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "body": f"document {i} " * 50}) for i in range(40)) + "\n")
    cfg, _ = resolve({"data": {"source": str(src), "text_field": "body"}, "model": {"seq_len": SEQ}})
    data = open_data(cfg)
    text = bytes(data.tokens[:60].tolist())
    assert text.startswith(b"document 0 document 0") and len(data.tokens) > 40 * 500
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 2 has no string field 'text'"):
        open_data(resolve({"data": {"source": str(bad)}, "model": {"seq_len": SEQ}})[0])
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 2 is not JSON"):
        open_data(resolve({"data": {"source": str(bad)}, "model": {"seq_len": SEQ}})[0])


def _documents() -> list[dict]:
    return [{"id": i, "body": f"document {i} says {'abc'[i % 3]} " * (20 + i % 7)} for i in range(60)]


def _tokens(tmp_path: Path, source: Path, **data: object) -> object:
    cfg, _ = resolve({"data": {"source": str(source), "text_field": "body", **data},
                      "model": {"seq_len": SEQ, "vocab_size": 320}, "log": {"run_dir": str(tmp_path / "run")}})
    return open_data(cfg).tokens


def test_parquet_and_saved_datasets_sources_read_the_same_text_as_jsonl(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the datasets extra (capstan-engine[hf]) is not installed")
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _documents()
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    table = pa.Table.from_pylist(docs)
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=7)  # several record batches
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(3):  # read in file-name order
        pq.write_table(table.slice(20 * k, 20), shards / f"part-{k:02d}.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(docs)}).save_to_disk(str(tmp_path / "saved"))

    want = _tokens(tmp_path, tmp_path / "docs.jsonl")
    for source in ("docs.parquet", "shards", "saved"):
        assert np.array_equal(_tokens(tmp_path, tmp_path / source), want), source
    with pytest.raises(DataError,
                       match=r"docs.parquet has no column 'text' \(data.text_field\); its columns: id, body"):
        open_data(resolve({"data": {"source": str(tmp_path / "docs.parquet")}, "model": {"seq_len": SEQ}})[0])
    with pytest.raises(DataError, match=r"record 0 of a batch has a int in column 'id', not a string"):
        _tokens(tmp_path, tmp_path / "docs.parquet", text_field="id")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"broken.parquet is not a readable Parquet file"):
        _tokens(tmp_path, tmp_path / "broken.parquet")


def test_a_transformers_tokenizer_folder_tokenizes_a_parquet_source_and_trains(tmp_path: Path) -> None:
    """data.tokenizer_file = a save_pretrained folder: its tokenizer.json gives the ids, packed into
    seq_len sequences; `capstan train` runs on them."""
    pytest.importorskip("datasets", reason="the datasets extra (capstan-engine[hf]) is not installed")
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from capstan.engine import cli
    from capstan.engine.data import bpe

    docs = _documents()
    pq.write_table(pa.Table.from_pylist(docs), tmp_path / "docs.parquet")
    text = "\n\n".join(d["body"] for d in docs)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.train_bpe(text.encode(), 300))
    tok.save_pretrained(tmp_path / "tok")
    ids = _tokens(tmp_path, tmp_path / "docs.parquet", tokenizer="bpe", tokenizer_file=str(tmp_path / "tok"))
    assert ids.tolist() == tok(text)["input_ids"] and len(ids) < len(text) // 2  # merges were used
    with pytest.raises(ConfigError, match=r"data.tokenizer_file = .* is a folder without a tokenizer.json"):
        _tokens(tmp_path, tmp_path / "docs.parquet", tokenizer="bpe", tokenizer_file=str(tmp_path))

    run = tmp_path / "train"
    (tmp_path / "c.json").write_text(json.dumps({
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 4, "seq_len": SEQ, "vocab_size": 320},
        "data": {"source": str(tmp_path / "docs.parquet"), "text_field": "body", "tokenizer": "bpe",
                 "tokenizer_file": str(tmp_path / "tok")},
        "train": {"steps": 8, "micro_batch_size": 4, "lr": 3e-3}, "log": {"run_dir": str(run)}}))
    assert cli.main(["train", "--config", str(tmp_path / "c.json")]) == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 8 and records[-1]["loss"] < records[0]["loss"]
    assert (run / "tokenizer.json").read_text() == (tmp_path / "tok" / "tokenizer.json").read_text()
