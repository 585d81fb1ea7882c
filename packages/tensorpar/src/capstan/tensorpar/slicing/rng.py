"""Dropout random streams for tensor parallelism.

Two kinds of activations need two kinds of randomness (Megatron-LM, Shoeybi et
al. 2019, section 3, "random number generation"; Megatron's
``model_parallel_cuda_manual_seed``):

- Replicated activations (the residual stream without sequence parallelism,
  the embedding output) are the same tensor on every tp rank. Their dropout
  mask must be identical on every rank, or the "replicas" silently diverge.
- Sliced activations (attention probabilities of this rank's heads, or the
  residual stream's tokens under sequence parallelism) are different pieces of
  one tensor. Their masks must differ between ranks, or every slice would
  reuse the same mask pattern and dropout would be correlated across heads.

`TensorParallelRNG` owns one torch.Generator per stream (and device), seeded
``seed`` for the replicated stream and ``seed + 2718 + tp_rank`` for the
sliced stream (Megatron's offset). Because the streams are explicit
generators, user code that draws from the global RNG cannot desynchronize
them, and nothing global is swapped in and out.
"""

from __future__ import annotations

import torch

from capstan.comm import Group

__all__ = ["TensorParallelRNG", "dropout", "TP_SEED_OFFSET"]

TP_SEED_OFFSET = 2718


class TensorParallelRNG:
    """The replicated and the per-tp-rank dropout streams of one model."""

    def __init__(self, group: Group, seed: int) -> None:
        self.group = group
        self.seed = seed
        self._gens: dict[tuple[str, torch.device], torch.Generator] = {}

    def _get(self, kind: str, device: torch.device) -> torch.Generator:
        if device.type == "meta":  # a forward for shapes only (chunkmem's trace order): nothing is drawn
            device = torch.device("cpu")
        key = (kind, torch.device(device))
        gen = self._gens.get(key)
        if gen is None:
            seed = self.seed if kind == "replicated" else self.seed + TP_SEED_OFFSET + self.group.rank
            gen = torch.Generator(device=device).manual_seed(seed)
            self._gens[key] = gen
        return gen

    def replicated(self, device: torch.device | str = "cpu") -> torch.Generator:
        """Same sequence on every tp rank: for activations every rank holds whole."""
        return self._get("replicated", torch.device(device))

    def tensor_parallel(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A different sequence on each tp rank: for activations split across ranks."""
        return self._get("tensor_parallel", torch.device(device))

    def get_states(self, device: torch.device | str = "cpu") -> dict[tuple[str, torch.device], torch.Tensor]:
        """Every stream's generator state (both streams on `device` created first, so a stream first
        drawn from after this call is covered too); `set_states` puts them back (recompute.py)."""
        self.replicated(device)
        self.tensor_parallel(device)
        return {key: gen.get_state() for key, gen in self._gens.items()}

    def set_states(self, states: dict[tuple[str, torch.device], torch.Tensor]) -> None:
        for key, state in states.items():
            self._gens[key].set_state(state)


def dropout(x: torch.Tensor, p: float, training: bool, generator: torch.Generator) -> torch.Tensor:
    """Inverted dropout drawing its mask from `generator` (F.dropout only uses the global RNG)."""
    if not training or p == 0.0 or x.is_meta:  # a meta tensor has no values to drop
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p, generator=generator)
    return x * keep * (1.0 / (1.0 - p))
