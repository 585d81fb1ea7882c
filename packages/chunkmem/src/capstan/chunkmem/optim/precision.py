"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, with DeepSpeed's hysteresis).

The loss is multiplied by `scale` before backward so small fp16 gradients do
not flush to zero. An overflow (inf/NaN gradient) skips the step; after
`hysteresis` consecutive overflows the scale is halved (never below
`min_scale`); after `window` clean steps it doubles.

At `min_scale` the scale cannot fall further, and a run whose gradients keep
overflowing there would skip every remaining step without a word (DeepSpeed
users meet this as "Current loss scale already at minimum"). With
`raise_at_min_scale`, the overflow that would halve the scale below the
minimum raises `LossScaleError` instead; capstan.engine turns that on by default.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DynamicLossScaler", "LossScaleError"]


class LossScaleError(RuntimeError):
    """fp16 gradients kept overflowing at the minimum loss scale: the run no longer trains."""


@dataclass
class DynamicLossScaler:
    initial_scale: float = 2.0**16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    raise_at_min_scale: bool = False

    def __post_init__(self) -> None:
        if self.initial_scale <= 0 or self.min_scale <= 0 or self.window < 1 or self.hysteresis < 1:
            raise ValueError(f"invalid loss-scaling settings: {self}")
        self.scale = float(self.initial_scale)
        self.skipped = 0
        self._clean = 0
        self._tolerance = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Adjust the scale after a step that did (True) or did not overflow."""
        if overflow:
            self.skipped += 1
            self._clean = 0
            self._tolerance -= 1
            if self._tolerance <= 0:
                if self.raise_at_min_scale and self.scale <= self.min_scale:
                    raise LossScaleError(
                        f"fp16 gradients overflowed (inf/NaN) {self.hysteresis} time(s) at the minimum loss "
                        f"scale {self.min_scale:g}: the model no longer trains (diverged, or its "
                        "values exceed fp16's range); try bf16, a lower learning rate, or a lower min_scale")
                self.scale = max(self.scale / 2, self.min_scale)
                self._tolerance = self.hysteresis
            return
        self._clean += 1
        if self._clean >= self.window:
            self.scale *= 2
            self._clean = 0
            self._tolerance = self.hysteresis

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "skipped": self.skipped, "clean": self._clean, "tolerance": self._tolerance}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.skipped = float(state["scale"]), int(state["skipped"])
        self._clean, self._tolerance = int(state["clean"]), int(state["tolerance"])
