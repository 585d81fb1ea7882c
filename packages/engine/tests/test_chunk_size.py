"""memory.chunk_size unset: chunks sized for the model; set: used as given."""

from __future__ import annotations

from capstan.chunkmem import ChunkKind
from capstan.engine import initialize


def _engine(memory: dict):
    return initialize(config={"model": {"n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16},
                              "data": {"max_bytes": 50_000}, "train": {"steps": 1, "warmup_steps": 0},
                              "memory": memory})


def _allocated_and_used(engine) -> tuple[int, int]:
    chunks = [c for group in engine.module.chunks[ChunkKind.PARAM] for c in group]
    return sum(c.capacity for c in chunks), sum(p.numel() for p in engine.module.parameters())


def test_unset_chunk_size_fits_the_model() -> None:
    engine = _engine({"offload": "cpu"})
    allocated, used = _allocated_and_used(engine)
    engine.close()
    # ~30k parameters in four chunk lists (tp-sliced or not x decayed or not): 2^20-element chunks
    # would allocate over 4M elements; the chosen size wastes less than the parameters it holds.
    assert engine.module.chunk_size < 1 << 20 and engine.module.chunk_size % 1024 == 0
    assert allocated < 2 * used, (allocated, used)


def test_set_chunk_size_is_used() -> None:
    engine = _engine({"offload": "cpu", "chunk_size": 16384})
    engine.close()
    assert engine.module.chunk_size == 16384
