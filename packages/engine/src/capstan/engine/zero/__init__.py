"""ZeRO stages 0-2 over one flat fp32 buffer (`optimizer`), its gradient buckets that communicate
during backward (`buckets`) and its parameter all-gather overlapped with the next forward (`gather`).
Stage 3 lives in capstan.chunkmem (sharded chunks)."""

from .optimizer import STAGE_COPY_ATTR, Segment, ZeroOptimizer, decays, is_stage_copy

__all__ = ["STAGE_COPY_ATTR", "Segment", "ZeroOptimizer", "decays", "is_stage_copy"]
