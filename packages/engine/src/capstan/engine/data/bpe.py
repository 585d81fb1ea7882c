"""Optional byte-level BPE tokenizer (``[data] tokenizer = "bpe"``), trained with HuggingFace `tokenizers`.

The tokenizer is GPT-2's scheme: text is split by the ByteLevel pre-tokenizer
(each UTF-8 byte maps to one of 256 printable symbols, so any text encodes and
``decode(encode(x)) == x``), then BPE merges learned on the training split up
to ``model.vocab_size`` ids. No special tokens: the 256 byte symbols are the
alphabet and every further id is a merge.

**Deterministic.** The same text and vocabulary size give the same
tokenizer.json on every rank and every run (the trainer's counts and its
tie-breaking by pair order do not depend on threads or hash seeds; a test trains
twice and compares the files), so every rank trains its own copy in
`open_data`, before any process group exists, and the ids agree without any
communication. The run keeps ``<log.run_dir>/tokenizer.json`` (written with an
atomic rename, so ranks writing the same bytes at once are harmless);
``data.tokenizer_file`` or ``checkpoint.resume`` load one instead of training.

Example::

    tok = train_bpe(b"some text ...", vocab_size=512)
    ids = encode(tok, b"some text")          # uint16/uint32 array
    assert decode(tok, ids) == "some text"
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BYTE_ALPHABET", "available", "train_bpe", "load_bpe", "save_bpe", "encode", "decode", "INSTALL_HINT"]

BYTE_ALPHABET = 256  # the ByteLevel pre-tokenizer's symbols: the smallest possible vocabulary
INSTALL_HINT = "pip install tokenizers (or capstan-engine[bpe])"


def available() -> bool:
    from importlib.util import find_spec

    return find_spec("tokenizers") is not None


def _text(data: bytes) -> str:
    # ByteLevel works on str. Source text is UTF-8; a character cut by max_bytes or a stray
    # invalid byte becomes U+FFFD rather than failing (the byte tokenizer never fails either).
    return data.decode("utf-8", errors="replace")


def train_bpe(data: bytes, vocab_size: int) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with at most `vocab_size` ids, learned from `data`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size <= BYTE_ALPHABET:
        raise ValueError(f"a byte-level BPE needs vocab_size > {BYTE_ALPHABET}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([_text(data)], trainer=trainer)
    return tok


def load_bpe(path: str | Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def save_bpe(tok: Any, path: str | Path) -> Path:
    """Write tokenizer.json atomically (temp file + rename: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # unique per rank
    tmp.write_text(tok.to_str(pretty=True), encoding="utf-8")
    os.replace(tmp, path)
    return path


def encode(tok: Any, data: bytes) -> np.ndarray:
    """Token ids of `data` (uint16 when they fit, else uint32)."""
    ids = tok.encode(_text(data)).ids
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    return np.asarray(ids, dtype=dtype)


def decode(tok: Any, ids: Any) -> str:
    return tok.decode([int(i) for i in ids])
