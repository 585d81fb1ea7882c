"""Training data: text or pre-tokenized sources and the deterministic batch order (`sources`), and the
optional byte-level BPE tokenizer (`bpe`, needs the tokenizers package)."""

from .datasets import dataset_batches, default_collate
from .sources import (
    BYTE_VOCAB,
    DataError,
    TokenData,
    bpe_tokenizer,
    byte_tokenize,
    micro_batch,
    open_data,
    read_text_source,
    stdlib_text,
    step_starts,
    train_batches,
    val_batches,
)

__all__ = ["BYTE_VOCAB", "DataError", "TokenData", "bpe_tokenizer", "byte_tokenize", "dataset_batches",
           "default_collate", "micro_batch", "open_data", "read_text_source", "step_starts", "stdlib_text",
           "train_batches", "val_batches"]
