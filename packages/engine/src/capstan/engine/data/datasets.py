"""Batches from a dataset of your own, sharded over dp as capstan's own data is, and resumable at a step.

    ds = MyDataset()                                      # a torch Dataset, a list, or an iterable
    it = dataset_batches(ds, engine.config, dp=engine.groups.dp.size, dp_rank=engine.groups.dp.rank)
    engine.train_batch(it)

Global step s takes the samples ``[s·G, (s+1)·G)`` of one sample stream (G =
micro × accum × dp, the global batch), and micro-batch a of dp rank r takes
``[(a·dp + r)·micro, +micro)`` of them, the rule `sources.micro_batch` follows:
so dp = 4 with accumulation 1 and dp = 1 with accumulation 4 train on the same
micro-batches, and a run resumed at step k (``start_step=k``) continues with
the batches the uninterrupted run would have seen.

The stream: a map-style dataset (``__len__`` and ``__getitem__``) is read in a
permutation per epoch drawn from (train.seed, epoch) (``shuffle=False``: in
order), so any index is found without reading what comes before; an iterable
is read in its own order, every rank reading all of it and keeping its own
samples (resume skips the first k·G).

A sample is collated by `collate` (default `default_collate`): a dict of
tensors stacks into a dict batch (the model is called with it as keywords,
outputs.py), a tuple into a tuple, and a sequence of seq_len + 1 token ids
into ``(inputs, targets)`` shifted by one, as capstan's own data.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..config.schema import Config
from .sources import DataError

__all__ = ["dataset_batches", "default_collate", "sample_index"]


def sample_index(position: int, length: int, seed: int, shuffle: bool = True) -> int:
    """The dataset index at `position` of the sample stream of a map-style dataset of `length` samples."""
    epoch, offset = divmod(position, length)
    if not shuffle:
        return offset
    return int(np.random.default_rng([seed, epoch]).permutation(length)[offset])


def default_collate(samples: Sequence[Any]) -> Any:
    """Stack samples into a batch (see the module docstring)."""
    first = samples[0]
    if isinstance(first, Mapping):
        return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in first}
    if isinstance(first, tuple):
        return tuple(torch.stack([torch.as_tensor(s[i]) for s in samples]) for i in range(len(first)))
    block = torch.stack([torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in samples])
    if block.shape[1] < 2:
        raise DataError(f"a token sample needs seq_len + 1 ids (inputs and the shifted targets), got {block.shape[1]}")
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def dataset_batches(dataset: Any, cfg: Config, dp: int, dp_rank: int, start_step: int = 0, shuffle: bool = True,
                    collate: Callable[[Sequence[Any]], Any] = default_collate) -> Iterator[Any]:
    """This rank's micro-batches of `dataset`, step by step, accum_steps per step (see the module docstring)."""
    micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
    global_batch = micro * accum * dp
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        length = len(dataset)
        if length == 0:
            raise DataError("the dataset is empty")
        seed = cfg.train.seed
        step = start_step
        while True:
            base = step * global_batch
            for a in range(accum):
                first = base + (a * dp + dp_rank) * micro
                yield collate([dataset[sample_index(p, length, seed, shuffle)] for p in range(first, first + micro)])
            step += 1
    elif isinstance(dataset, Iterable):
        stream = iter(dataset)
        try:
            if start_step:
                skipped = sum(1 for _ in itertools.islice(stream, start_step * global_batch))
                if skipped < start_step * global_batch:
                    raise DataError(f"the dataset ended after {skipped} samples, before step {start_step} "
                                    f"({start_step * global_batch} samples)")
            while True:
                step_samples = list(itertools.islice(stream, global_batch))
                if len(step_samples) < global_batch:
                    return  # the iterable is exhausted: no partial step
                for a in range(accum):
                    first = (a * dp + dp_rank) * micro
                    yield collate(step_samples[first : first + micro])
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
    else:
        raise DataError(f"a dataset must be map-style (__len__, __getitem__) or iterable, got {type(dataset).__name__}")
