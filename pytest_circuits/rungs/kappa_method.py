"""How rung 1 measures kappa: which unembedding, which rotation null. Declared once here.

A scan record says how its kappa was measured (its ``rung1`` section: ``unembedding``,
``n_rotations``, ``p_method``, ``null_dtype``), and the gate measures a candidate build the way
its baseline was measured (`of_record`), so kappa, kappa_z and the flags are always compared
like with like. New records use `KappaMethod()` (the centred unembedding and the 32-draw t
null); a record that does not say is an older one: `LEGACY`, the uncentred unembedding and
the 256-draw float64 normal-p null the first baselines were recorded with.

Light: no torch, numpy or pandas (settings and the gate import it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

UNEMBEDDINGS = ("centred", "uncentred")  # W_U minus its mean over the vocabulary, or W_U as stored
P_METHODS = ("t", "normal", "empirical")
NULL_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class KappaMethod:
    """The unembedding kappa reads (docs/definitions.md, "Rung 1") and its rotation null's settings."""

    unembedding: str = "centred"
    n_rotations: int = 32
    p_method: str = "t"
    null_dtype: str = "float32"

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """``centred W_U, 32-draw float32 t null``."""
        return f"{self.unembedding} W_U, {self.n_rotations}-draw {self.null_dtype} {self.p_method} null"


LEGACY = KappaMethod(unembedding="uncentred", n_rotations=256, p_method="normal", null_dtype="float64")
KEYS = tuple(f.name for f in fields(KappaMethod))


def of_record(record: dict) -> KappaMethod:
    """How ``record``'s kappa was measured: its ``rung1`` keys, `LEGACY` for each key it lacks."""
    rung1 = record.get("rung1") if isinstance(record, dict) else None
    rung1 = rung1 if isinstance(rung1, dict) else {}
    return KappaMethod(**{key: rung1.get(key, getattr(LEGACY, key)) for key in KEYS})
