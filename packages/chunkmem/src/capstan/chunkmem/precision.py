"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, with DeepSpeed's hysteresis).

The loss is multiplied by `scale` before backward so small fp16 gradients do
not flush to zero. An overflow (inf/NaN gradient) skips the step; after
`hysteresis` consecutive overflows the scale is halved (never below
`min_scale`); after `window` clean steps it doubles.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DynamicLossScaler"]


@dataclass
class DynamicLossScaler:
    initial_scale: float = 2.0**16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

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
