"""The seeds of the sequential rule's looks: look 1 is the record's own probe, each further look a
fixed, distinct draw derived from it, so a baseline and a build pair on the same sequences."""

from __future__ import annotations

import numpy as np


def look_seed(seed: int, look: int) -> int:
    """The seed of look ``look`` of a probe seeded ``seed``: ``seed`` itself for look 1 (today's
    batch), else the first 32-bit word of ``numpy.random.SeedSequence([seed, look])``."""
    if look == 1:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(look)]).generate_state(1, np.uint32)[0])
