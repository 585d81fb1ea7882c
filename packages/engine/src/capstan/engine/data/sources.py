"""Training data: a token stream, a held-out tail, and layout-independent batches.

Sources (``[data] source``):

* ``"stdlib"``: the running Python's standard-library ``.py`` files, sorted by
  path and capped at ``max_bytes`` — real text on every machine, no download;
* a text file, or a folder of them (sorted recursively, hidden files skipped);
* a JSON Lines file (``.jsonl``): the ``data.text_field`` of every record, documents separated by
  a blank line;
* Parquet (a ``.parquet`` file or a folder of them, read a record batch at a time with pyarrow)
  or a folder written by the `datasets` library's ``save_to_disk`` (memory-mapped Arrow, read
  with ``datasets.load_from_disk``): the ``data.text_field`` column, packed the same way. Both
  need the `datasets` package (capstan-engine[hf]); neither writes a cache, so every rank can
  read the same files at once;
* a pre-tokenized ``.bin`` file: a flat uint16/uint32 array of ids (nanoGPT's format), memory-mapped.

Text goes through the byte tokenizer (id = byte value, vocabulary 256), or,
with ``tokenizer = "bpe"``, a byte-level BPE (bpe.py) learned from the training
part of the text only, saved as ``<log.run_dir>/tokenizer.json``; see
`bpe_tokenizer` for when an existing one is loaded instead. The last
``val_fraction`` of the stream is the validation split.

**Batches do not depend on the layout.** Global step k has ``B = micro ×
accum × dp`` sequences whose starts are drawn from a generator seeded with
(seed, k); micro-batch a of data-parallel rank r takes the sequences
``[(a·dp + r)·micro, +micro)``. So dp=4, accum=1 and dp=1, accum=4 train on
exactly the same sequences at every step, which is what makes every layout's
trajectory comparable with one process. Example::

    data = open_data(cfg)                              # DataError on bad input
    for x, y in train_batches(data, cfg, dp=2, dp_rank=0):   # [micro, seq_len] int64 each
        ...
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config.schema import Config, DataConfig
from . import bpe

__all__ = ["DataError", "TokenData", "open_data", "read_text_source", "stdlib_text", "byte_tokenize",
           "bpe_tokenizer", "step_starts", "micro_batch", "train_batches", "val_batches", "BYTE_VOCAB"]

BYTE_VOCAB = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """The data source is missing, empty, corrupt or too small; the message names it."""


def stdlib_text(max_bytes: int) -> bytes:
    """The standard library's ``.py`` sources in sorted path order, at most `max_bytes` (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruned, not filtered afterwards: site-packages alone can hold more files than the stdlib.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return _concat(sorted(files), max_bytes, f"the standard library at {root}")


def _concat(files: list[Path], max_bytes: int, what: str) -> bytes:
    parts, total = [], 0
    for path in files:
        try:
            blob = path.read_bytes()
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror}") from None
        parts.append(blob[: max_bytes - total])
        total += len(parts[-1])
        if total >= max_bytes:
            break
    text = b"\n".join(parts)[:max_bytes]
    if not text:
        raise DataError(f"{what} holds no text")
    return text


class _Packer:
    """Documents joined by blank lines into one byte stream, stopping at `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.parts: list[bytes] = []
        self.total, self.max_bytes = 0, max_bytes

    def add(self, text: str) -> bool:
        """Add one document; False once the stream is full."""
        blob = text.encode()
        self.parts.append(blob)
        self.total += len(blob) + 2
        return self.total < self.max_bytes

    def text(self, what: str) -> bytes:
        out = b"\n\n".join(self.parts)[: self.max_bytes]
        if not out:
            raise DataError(f"{what} holds no text")
        return out


def _jsonl_text(path: Path, field: str, max_bytes: int) -> bytes:
    """The `field` of every line of a JSON Lines file, in order, separated by blank lines (documents
    packed into one stream, which the batches cut into fixed-length sequences)."""
    import json

    packer = _Packer(max_bytes)
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"data.source {path} line {lineno} is not JSON: {exc}") from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise DataError(f"data.source {path} line {lineno} has no string field {field!r} "
                                    "(data.text_field)")
                if not packer.add(record[field]):
                    break
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    return packer.text(f"data.source {path}")


_DATASETS_HINT = "pip install datasets (or capstan-engine[hf])"


def _need_datasets(what: str) -> None:
    from importlib.util import find_spec

    if find_spec("pyarrow") is None or find_spec("datasets") is None:
        raise DataError(f"data.source {what} needs the datasets package: {_DATASETS_HINT}")


def _column_texts(values: list, field: str, where: str) -> list[str]:
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise DataError(f"data.source {where}: record {i} of a batch has a {type(v).__name__} in column "
                            f"{field!r}, not a string (data.text_field)")
    return values


def _parquet_text(files: list[Path], field: str, max_bytes: int, what: str) -> bytes:
    """The `field` column of Parquet files in order, read one record batch at a time (bounded RAM)."""
    _need_datasets(what)
    import pyarrow.parquet as pq

    packer = _Packer(max_bytes)
    for path in files:
        try:
            pf = pq.ParquetFile(path)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"data.source {path} is not a readable Parquet file: {exc}") from None
        names = pf.schema_arrow.names
        if field not in names:
            raise DataError(f"data.source {path} has no column {field!r} (data.text_field); its columns: "
                            f"{', '.join(names)}")
        for batch in pf.iter_batches(batch_size=1024, columns=[field]):
            for text in _column_texts(batch.column(0).to_pylist(), field, str(path)):
                if not packer.add(text):
                    return packer.text(what)
    return packer.text(what)


def _saved_dataset_text(path: Path, field: str, max_bytes: int) -> bytes:
    """The `field` column of a `datasets` ``save_to_disk`` folder (its "train" split for a DatasetDict)."""
    what = f"{path} (a datasets save_to_disk folder)"
    _need_datasets(what)
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as exc:
        raise DataError(f"data.source {what} cannot be loaded: {exc}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"data.source {what} has splits {', '.join(ds)} but no \"train\" split")
        ds = ds["train"]
    if field not in ds.column_names:
        raise DataError(f"data.source {what} has no column {field!r} (data.text_field); its columns: "
                        f"{', '.join(ds.column_names)}")
    packer = _Packer(max_bytes)
    for start in range(0, len(ds), 1024):
        for text in _column_texts(ds[start : start + 1024][field], field, str(path)):
            if not packer.add(text):
                return packer.text(f"data.source {what}")
    return packer.text(f"data.source {what}")


def read_text_source(source: str, max_bytes: int, text_field: str = "text") -> bytes:
    if source == "stdlib":
        return stdlib_text(max_bytes)
    path = Path(source)
    if path.is_file() and path.suffix == ".jsonl":
        return _jsonl_text(path, text_field, max_bytes)
    if path.is_file() and path.suffix == ".parquet":
        return _parquet_text([path], text_field, max_bytes, f"data.source {path}")
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        return _saved_dataset_text(path, text_field, max_bytes)
    if path.is_dir() and (parquet := sorted(path.rglob("*.parquet"))):
        return _parquet_text(parquet, text_field, max_bytes, f"data.source folder {path}")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise DataError(f"data.source folder {path} contains no files")
        return _concat(files, max_bytes, f"data.source folder {path}")
    if path.is_file():
        return _concat([path], max_bytes, f"data.source file {path}")
    raise DataError(f"data.source {source!r} does not exist (expected \"stdlib\", a text file, a folder or a .bin)")


def byte_tokenize(text: bytes) -> np.ndarray:
    """Byte-level tokenizer: each byte is its own id (vocabulary 256); never fails on any input."""
    return np.frombuffer(text, dtype=np.uint8)


def bpe_tokenizer(cfg: Config, train_text: bytes) -> Any:
    """The run's BPE: `data.tokenizer_file`, else on resume ``<run_dir>/tokenizer.json``, else trained.

    Whichever it is, it is (re)written to ``<run_dir>/tokenizer.json``, so the run directory always
    holds the ids its checkpoints were trained with. Training is deterministic, so every rank calls
    this independently (before any process group) and gets the same ids.
    """
    d, vocab = cfg.data, cfg.model.vocab_size
    saved = Path(cfg.log.run_dir) / "tokenizer.json"
    path = Path(d.tokenizer_file) if d.tokenizer_file else saved if cfg.checkpoint.resume and saved.is_file() else None
    if path is not None and path.is_dir():  # a transformers model or tokenizer folder (save_pretrained)
        path = path / "tokenizer.json"
    if path is None:
        tok = bpe.train_bpe(train_text, vocab)
    else:
        try:
            tok = bpe.load_bpe(path)
        except Exception as exc:  # tokenizers raises a bare Exception for a missing or malformed file
            raise DataError(f"cannot load the tokenizer {path}: {' '.join(str(exc).split())}") from None
        if tok.get_vocab_size() > vocab:
            raise DataError(f"the tokenizer {path} has {tok.get_vocab_size()} ids but model.vocab_size is {vocab}")
    if path is None or path.resolve() != saved.resolve():
        bpe.save_bpe(tok, saved)
    return tok


def _open_bin(path: Path, dtype: str, vocab_size: int) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"data.source {path} does not exist")
    item = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"data.source {path} is empty")
    if size % item:
        raise DataError(f"data.source {path} is {size} bytes, not a multiple of {item} ({dtype}): the file is "
                        f"corrupt or data.bin_dtype is wrong")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    top = int(tokens.max())  # one streaming pass; a wrong dtype usually shows up here
    if top >= vocab_size:
        where = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"data.source {path} holds token id {top} (first bad id at position {where}) but "
                        f"model.vocab_size is {vocab_size}: wrong data.bin_dtype or vocabulary")
    return tokens


@dataclass(frozen=True)
class TokenData:
    """The token stream; `[0, n_train)` trains, `[n_train, len)` validates."""

    tokens: np.ndarray
    n_train: int
    seq_len: int
    source: str

    @property
    def n_val(self) -> int:
        return len(self.tokens) - self.n_train


def open_data(cfg: Config) -> TokenData:
    """Read (or memory-map) the configured source and split it; DataError when unusable."""
    d: DataConfig = cfg.data
    seq = cfg.model.seq_len
    if d.source.endswith(".bin"):
        tokens = _open_bin(Path(d.source), d.bin_dtype, cfg.model.vocab_size)
    elif d.tokenizer == "bpe":
        text = read_text_source(d.source, d.max_bytes, d.text_field)
        # Learn merges from the training part of the text only, so validation stays held out.
        tok = bpe_tokenizer(cfg, text[: len(text) - int(len(text) * d.val_fraction)])
        tokens = bpe.encode(tok, text)
    else:
        tokens = byte_tokenize(read_text_source(d.source, d.max_bytes, d.text_field))
    n_val = int(len(tokens) * d.val_fraction)
    n_train = len(tokens) - n_val
    if n_train < seq + 2:
        raise DataError(f"data.source {d.source} has {n_train} training tokens; model.seq_len = {seq} needs at "
                        f"least {seq + 2}")
    if n_val < seq + 1:
        raise DataError(f"data.source {d.source}: the validation split has {n_val} tokens, fewer than "
                        f"model.seq_len + 1 = {seq + 1}; raise data.val_fraction or use more text")
    return TokenData(tokens=tokens, n_train=n_train, seq_len=seq, source=d.source)


def step_starts(data: TokenData, step: int, global_batch: int, seed: int) -> np.ndarray:
    """Start offsets [global_batch] of the training sequences of global step `step` (any layout)."""
    rng = np.random.default_rng([seed, step])  # PCG64: the same stream on every machine and numpy
    return rng.integers(0, data.n_train - data.seq_len, size=global_batch, dtype=np.int64)


def _windows(data: TokenData, starts: np.ndarray) -> tuple[object, object]:
    import torch

    idx = starts[:, None] + np.arange(data.seq_len + 1)[None, :]
    block = torch.from_numpy(np.asarray(data.tokens[idx], dtype=np.int64))  # [micro, seq_len + 1]
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def micro_batch(data: TokenData, cfg: Config, dp: int, step: int, accum_index: int, dp_rank: int) -> tuple:
    """(inputs, targets), each [micro, seq_len] int64: micro-batch `accum_index` of rank `dp_rank` at `step`."""
    micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
    starts = step_starts(data, step, micro * accum * dp, cfg.train.seed)
    first = (accum_index * dp + dp_rank) * micro
    return _windows(data, starts[first : first + micro])


def train_batches(data: TokenData, cfg: Config, dp: int, dp_rank: int, start_step: int = 0) -> Iterator[tuple]:
    """This rank's micro-batches in order: step by step, accum_steps per step, forever."""
    step = start_step
    while True:
        for a in range(cfg.train.grad_accum_steps):
            yield micro_batch(data, cfg, dp, step, a, dp_rank)
        step += 1


def val_batches(data: TokenData, cfg: Config, dp: int, dp_rank: int) -> list[tuple]:
    """This rank's share of a fixed validation set: non-overlapping windows of the held-out tail."""
    micro, seq = cfg.train.micro_batch_size, data.seq_len
    n_windows = (data.n_val - 1) // seq
    out = []
    for j in range(cfg.train.eval_batches):
        first = (j * dp + dp_rank) * micro
        ids = (np.arange(first, first + micro) % n_windows).astype(np.int64)  # cycle a short split
        out.append(_windows(data, data.n_train + ids * seq))
    return out
