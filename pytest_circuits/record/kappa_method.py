"""How rung 1 measures kappa: which unembedding, which rotation null. Declared once here.

A scan record says how its kappa was measured (its ``rung1`` section: ``unembedding``,
``n_rotations``, ``p_method``, ``null_dtype``, and ``min_effect``, the least ``|kappa - null mean|``
a flagged head shows), and the gate measures a candidate build the way
its baseline was measured (`of_record`), so kappa, kappa_z and the flags are always compared
like with like; two stored records measured in two ways pair only the figures that mean the
same on both sides (`paired_figures`). New records use `KappaMethod()` (the centred unembedding and the 32-draw t
null); a record that does not say is an older one: `LEGACY`, the uncentred unembedding and
the 256-draw float64 normal-p null the first baselines were recorded with, and no minimum effect
(every record written before ``min_effect`` flagged on the q-value alone: reading it as 0 says
what flagged its heads, and the gate flags the candidate the same way).

Light: no torch, numpy or pandas (settings and the gate import it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

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
    # A head is flagged copying/suppression only when its BH q <= q AND |kappa - null mean| >= min_effect
    # (likewise the _trace flags; 0: the q-value alone). 0.05: at d_head 256 a head's null sd is
    # 0.0067-0.01 (Gemma-3-270M's median 0.0074) and flags flip with the null's draw between about 2.3
    # and 3.5 sds; 0.05 is at least 5 sds there, so no flag flipped over 24 null seeds (39% of seed
    # pairs differed at 0), and a significant kappa of 0.015 (Gemma-3 flagged all 72 heads, down to
    # that) is no longer called copying. At d_head 64 (sd ~0.023) it removes some flips, not all.
    # docs/definitions.md, "Flags that hold across null draws", gives the measurements.
    min_effect: float = 0.05

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """``centred W_U, 32-draw float32 t null, min effect 0.05``."""
        null = f"{self.unembedding} W_U, {self.n_rotations}-draw {self.null_dtype} {self.p_method} null"
        return f"{null}, min effect {self.min_effect:g}"

    @property
    def null(self) -> KappaMethod:
        """The same scan with no minimum effect: what decides kappa, its null, z, p and q (not the flags)."""
        return replace(self, min_effect=0.0)


LEGACY = KappaMethod(unembedding="uncentred", n_rotations=256, p_method="normal", null_dtype="float64", min_effect=0.0)
KEYS = tuple(f.name for f in fields(KappaMethod))
FLAGS = ("copying", "suppression", "copying_trace", "suppression_trace")  # the figures min_effect decides


def of_record(record) -> KappaMethod:
    """How ``record``'s kappa was measured: its ``rung1`` keys, `LEGACY` for each key it lacks."""
    if isinstance(record, dict):
        rung1 = record.get("rung1")
    else:  # a typed `record.schema.Record`: the keys its rung1 was given
        info = getattr(record, "rung1", None)
        rung1 = {key: getattr(info, key) for key in info.model_fields_set} if info is not None else None
    rung1 = rung1 if isinstance(rung1, dict) else {}
    return KappaMethod(**{key: rung1.get(key, getattr(LEGACY, key)) for key in KEYS})


UNCENTRED_TWINS = {
    "kappa": "kappa_uncentred",
    "kappa_trace": "kappa_trace_uncentred",
}  # figure -> its twin on W_U as stored


def paired_figures(figure: str, before: KappaMethod, after: KappaMethod) -> tuple[str, str] | None:
    """``(figure of before, figure of after)`` that measure the same thing, or None when none do.

    Alike methods pair every figure with itself. kappa and kappa_trace do not depend on the null,
    only on the unembedding: across unembeddings the uncentred side's ``kappa`` pairs with the
    centred side's ``kappa_uncentred`` (likewise the trace). The ``*_uncentred`` figures pair with
    themselves. Everything the null decides (z, p, q) pairs only between alike nulls; the flags
    (`FLAGS`) only between alike methods, minimum effect included.
    """
    if before == after or figure in UNCENTRED_TWINS.values():
        return figure, figure
    if before.null == after.null and figure not in FLAGS:
        return figure, figure
    if figure not in UNCENTRED_TWINS:
        return None
    if before.unembedding == after.unembedding:
        return figure, figure
    twin = UNCENTRED_TWINS[figure]
    return (figure, twin) if before.unembedding == "uncentred" else (twin, figure)
