"""Datasets of one's own (data/datasets.py) and JSON Lines sources: batches that do not depend on the
layout, resume at a step, and train through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from capstan.engine import DataError, dataset_batches, initialize, open_data
from capstan.engine.config import resolve

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
