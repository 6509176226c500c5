"""Deprecated: the plain loops moved to `plain_loops.py` (``plain_*`` names), the FLOP count to `plan.py`.

Each old name still imports, with a `CircuitsDeprecationWarning` naming its replacement; goes in 0.3.
"""

from __future__ import annotations

import importlib
import warnings

from ..errors import CircuitsDeprecationWarning

MOVED = {  # old name: (module, new name)
    "naive_knockout_deltas": ("plain_loops", "plain_knockout_deltas"),
    "naive_losses": ("plain_loops", "plain_knockout_losses"),
    "unembedding_reference": ("plain_loops", "plain_unembedding"),
    "reduced_ov_reference": ("plain_loops", "plain_reduced_ov"),
    "kappa_reference": ("plain_loops", "plain_kappa"),
    "ov_spectrum_reference": ("plain_loops", "plain_ov_spectrum"),
    "knockout_flops": ("plan", "knockout_flops"),
}


def __getattr__(name: str):
    if name not in MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new = MOVED[name]
    warnings.warn(
        f"pytest_circuits.rungs.reference.{name} is deprecated and goes in 0.3; "
        f"use pytest_circuits.rungs.{module}.{new}",
        CircuitsDeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(f"..{module}", __name__), new)
