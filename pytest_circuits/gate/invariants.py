"""The gate's invariants, one registry entry each (docs/definitions.md, "The gate"): the extension
API (`invariant_api.py`: `Row`, `Comparison`, `Invariant`, `register`, `evaluate`, ...) with the
built-in invariants (`builtin_invariants.py`, rung 3's `audit_invariants.py`) and those across base models (`swap_invariants.py`)
registered, in gate order. Import the gate's names from here: every invariant is registered then.
"""

from __future__ import annotations

from . import audit_invariants, builtin_invariants, swap_invariants
from .builtin_invariants import (
    head_writes,
    kappa_pairs,
    key_heads,
    negligible_heads,
    other_knockout_settings,
    ov_gains,
    sampled_key_heads,
)
from .invariant_api import (
    MAX_ROWS,
    NOT_PASSED,
    REGISTRY,
    STATUSES,
    Comparison,
    Invariant,
    InvariantResult,
    Row,
    across_models,
    declared_tolerances,
    evaluate,
    format_interval,
    format_rows,
    gate_all,
    get,
    guarded,
    own_tolerance_defaults,
    per_build_invariants,
    register,
    runnable,
    tolerances_of,
    verdict,
    within,
)
from .user_invariants import load_entry_points

# the modules whose invariants are registered, in gate order
BUILT_IN = (builtin_invariants, audit_invariants, swap_invariants)
load_entry_points()  # then the installed packages' (group pytest_circuits.invariants), the same for both front ends

__all__ = [
    "MAX_ROWS",
    "NOT_PASSED",
    "REGISTRY",
    "STATUSES",
    "Comparison",
    "Invariant",
    "InvariantResult",
    "Row",
    "across_models",
    "declared_tolerances",
    "evaluate",
    "format_interval",
    "format_rows",
    "gate_all",
    "get",
    "guarded",
    "head_writes",
    "kappa_pairs",
    "key_heads",
    "negligible_heads",
    "other_knockout_settings",
    "ov_gains",
    "own_tolerance_defaults",
    "per_build_invariants",
    "register",
    "runnable",
    "sampled_key_heads",
    "tolerances_of",
    "verdict",
    "within",
]
