"""Gate tolerances: defaults < ini ``circuits_tol_<name>`` < ``@pytest.mark.circuits_tolerance``.

Every tolerance is declared once, on the invariant that owns it (``Invariant.tolerances``, a
`Tolerance` or a plain default per name; docs/invariants.md). Light (no numpy): the plugin
registers one ini key per tolerance at start-up, so the built-in ones are read from
`tolerance_table.BUILT_IN`, which ``scripts/regenerate_docs.py`` writes from the registry
(tests/test_docs.py fails when it is out of step); a user invariant's are read from the
registry itself once it is registered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import did_you_mean
from .tolerance_table import BUILT_IN

Number = float | int | bool


@dataclass(frozen=True)
class Tolerance:
    """One tolerance an invariant declares: its default (its type is the tolerance's: a bool is an
    on/off flag, an int a count, a float a limit), what it means, and the least value it takes
    (``None``: any)."""

    default: Number
    doc: str = ""
    minimum: float | int | None = 0

    @classmethod
    def of(cls, declared: Tolerance | Number) -> Tolerance:
        """A declaration from a `Tolerance` or a plain default."""
        return declared if isinstance(declared, Tolerance) else cls(declared)


def _no_registry() -> dict[str, Tolerance]:
    return {}


# name -> declaration of every registered invariant's tolerance; gate/invariant_api.py installs its
# reader (this module stays light and imports no invariant)
DECLARED: Callable[[], dict[str, Tolerance]] = _no_registry


def declarations() -> dict[str, Tolerance]:
    """Every tolerance: the built-in ones (the generated table), then the other registered ones."""
    known = {name: Tolerance(*row) for name, row in BUILT_IN.items()}
    return {**known, **{name: t for name, t in DECLARED().items() if name not in known}}


class Tolerances:
    """One gate's tolerances: each is an ini key ``circuits_tol_<name>``, a marker keyword and a
    ``--tol`` name, read as ``tol.<name>``. ``Tolerances(kappa=0.2)`` overrides defaults."""

    __slots__ = ("_set",)

    def __init__(self, **overrides: Any):
        object.__setattr__(self, "_set", {})
        if overrides:
            object.__setattr__(self, "_set", self.updated(overrides)._set)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The built-in tolerances."""
        return tuple(BUILT_IN)

    @classmethod
    def all_names(cls) -> tuple[str, ...]:
        """The built-in tolerances, then the other registered invariants' own."""
        return tuple(declarations())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        found = self._set.get(name)
        if found is not None:
            return found
        known = declarations()
        if name in known:
            return known[name].default
        raise AttributeError(f"no tolerance {name!r}{did_you_mean(name, tuple(known))}; known: {', '.join(known)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Tolerances are frozen: use .updated({...})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tolerances) and self.values() == other.values()

    def __hash__(self) -> int:
        return hash(tuple(self.values().items()))

    def __repr__(self) -> str:
        return f"Tolerances({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"

    def updated(self, overrides: Mapping[str, Any]) -> Tolerances:
        """A copy with ``overrides`` applied; unknown names or bad values raise ValueError."""
        known = declarations()
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            said = ", ".join(name + did_you_mean(name, tuple(known)) for name in unknown)
            raise ValueError(f"unknown tolerance(s) {said}; known: {', '.join(known)}")
        clean = dict(self._set)
        for name, value in overrides.items():
            clean[name] = _checked(name, value, known[name])
        copy = Tolerances()
        object.__setattr__(copy, "_set", clean)
        return copy

    def values(self) -> dict[str, Any]:
        """Every tolerance's value, as set or by its default."""
        return {name: getattr(self, name) for name in self.all_names()}

    def as_dict(self) -> dict[str, Any]:
        """The built-in tolerances' values."""
        return {name: getattr(self, name) for name in self.names()}

    def own_values(self) -> dict[str, Any]:
        """The other registered invariants' tolerances, as set or by their default."""
        return {name: value for name, value in self.values().items() if name not in BUILT_IN}


_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _checked(name: str, value: Any, declared: Tolerance) -> Number:
    """``value`` as tolerance ``name`` takes it (the type of its default); ValueError otherwise."""
    if isinstance(declared.default, bool):  # a flag: a bool or 1/0, true/false, yes/no, on/off
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word not in _WORDS:
            raise ValueError(f"tolerance {name} must be true or false, got {value!r}")
        return _WORDS[word]
    kind = int if isinstance(declared.default, int) else float
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"tolerance {name} must be a number, got {value!r}") from None
    if not number == number:  # NaN would make every comparison fail silently
        raise ValueError(f"tolerance {name} must be a number, got {value!r}")
    if declared.minimum is not None and number < declared.minimum:
        raise ValueError(f"tolerance {name} must be >= {declared.minimum}, got {value!r}")
    return number
