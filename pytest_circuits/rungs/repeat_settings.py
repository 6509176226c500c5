"""The random-repeat probe's settings, light (no torch) so `settings.py` can hold them: seed, ``n``, ``L``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RepeatSettings:
    """Probe settings that fix its tokens: seed, sequences ``n``, segment length ``L``."""

    seed: int = 0
    n: int = 8
    L: int = 64

    def as_dict(self) -> dict:
        return {"seed": self.seed, "n": self.n, "L": self.L}
