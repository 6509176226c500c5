"""Gate tolerances: defaults < ini ``circuits_tol_<name>`` < ``@pytest.mark.circuits_tolerance``.

Light (no numpy): the plugin registers one ini key per field at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import did_you_mean

INTEGER = ("top_k", "swap_induction_heads", "looks")  # counts; every other tolerance is a float


@dataclass(frozen=True)
class Tolerances:
    """Each field is an ini key ``circuits_tol_<name>``, a marker keyword and a ``--tol`` name."""

    kappa: float = 0.15  # |delta kappa| and |delta kappa_trace| per head
    rank: float = 0.80  # minimum Spearman rank correlation of kappa across heads
    shift: float = 1.0  # |mean delta kappa_z| across heads, in null standard deviations
    ov_gain: float = 0.1  # |ln(ov_gain' / ov_gain)| of key heads (0.1: about 10%)
    copy_loss: float = 0.25  # |delta copy loss|, nats
    copy_gain: float = 0.25  # |delta copy gain|, nats
    prefix: float = 0.10  # |delta prefix_matching| / |delta previous_token| of key heads
    knockout: float = 0.5  # |delta knockout_delta| / |knockout_delta| of key heads
    top_k: int = 0  # at most this many key heads per routing score and for knockouts (0: every one)
    min_score: float = 0.2  # a routing score below this does not make a key head
    min_delta: float = 0.1  # a knockout delta below this (nats) does not make a key head
    min_ov_gain: float = 0.01  # heads with OV gain below this x the largest: kappa not compared
    # copy_loss and knockout_deltas weigh sampling noise: by the sequential rule (looks), or, against a
    # baseline without looks, a change fails only when beyond its tolerance and its 95% paired interval
    # over the probe's sequences excludes 0 (the fixed rule); off: the plain tolerance
    outside_interval: bool = True
    # the most looks of the sequential rule (gate/sequential.py), each n fresh probe sequences, drawn
    # while a change is undecided; a pass needs the change shown within its tolerance; 1: the fixed rule
    looks: int = 4
    # across base models (gate/profile.py; docs/definitions.md, "Across base models")
    swap_copy_loss: float = 0.5  # how far copy loss may rise, nats
    swap_copy_gain: float = 0.1  # how far copy_gain / first_copy_loss may fall
    swap_induction_score: float = 0.3  # prefix_matching that makes an induction head
    swap_induction_heads: int = 1  # induction heads the new model needs (at most the old model's count)
    swap_prefix: float = 0.15  # how far the best prefix_matching may fall
    swap_depth: float = 0.35  # how far the induction heads' mean depth (fraction of the stack) may move
    swap_share: float = 0.25  # how far the shares of copying / suppression heads may move
    swap_kappa_w1: float = 5.0  # 1-Wasserstein distance of the kappa_z distributions, null sds
    swap_knockout: float = 0.5  # how far the largest knockout delta may fall, x its size
    swap_concentration: float = 0.3  # how far the top-3 share of the knockout effect may move
    # the values set for registered invariants' own tolerances (`Invariant.own_tolerances`);
    # one left out reads as its declared default
    own: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The built-in tolerances."""
        return tuple(f.name for f in fields(cls) if f.name != "own")

    @classmethod
    def all_names(cls) -> tuple[str, ...]:
        """The built-in tolerances, then the registered invariants' own."""
        return cls.names() + tuple(n for n in OWN_DEFAULTS() if n not in cls.names())

    def __getattr__(self, name: str) -> Any:  # only for names that are not fields: the own tolerances
        own = self.__dict__.get("own", {})
        if name in own:
            return own[name]
        defaults = OWN_DEFAULTS()
        if name in defaults:
            return defaults[name]
        raise AttributeError(
            f"no tolerance {name!r}{did_you_mean(name, self.all_names())}; known: {', '.join(self.all_names())}"
        )

    def updated(self, overrides: dict) -> Tolerances:
        """A copy with ``overrides`` applied; unknown names or bad values raise ValueError."""
        unknown = sorted(set(overrides) - set(self.all_names()))
        if unknown:
            said = ", ".join(name + did_you_mean(name, self.all_names()) for name in unknown)
            raise ValueError(f"unknown tolerance(s) {said}; known: {', '.join(self.all_names())}")
        clean: dict[str, Any] = {}
        own_defaults = OWN_DEFAULTS()
        for name, value in overrides.items():
            own_default = own_defaults.get(name) if name not in self.names() else None
            if name in FLAGS or isinstance(own_default, bool):
                clean[name] = _flag(name, value)
                continue
            kind = int if name in INTEGER or isinstance(own_default, int) else float
            try:
                clean[name] = kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"tolerance {name} must be a number, got {value!r}") from None
            if not clean[name] == clean[name]:  # NaN would make every comparison fail silently
                raise ValueError(f"tolerance {name} must be a number, got {value!r}")
            if clean[name] < 0 and name != "rank":
                raise ValueError(f"tolerance {name} must be >= 0, got {value!r}")
            if name == "looks" and clean[name] < 1:
                raise ValueError(f"tolerance looks must be >= 1 (1: the fixed rule), got {value!r}")
        own = {name: clean.pop(name) for name in list(clean) if name not in self.names()}
        return replace(self, own={**self.own, **own}, **clean)

    def as_dict(self) -> dict:
        """The built-in tolerances' values."""
        values = asdict(self)
        values.pop("own")
        return values

    def own_values(self) -> dict:
        """Every registered invariant's own tolerance, as set or by its default."""
        return {name: getattr(self, name) for name in OWN_DEFAULTS()}


def _no_own() -> dict[str, Any]:
    return {}


# name -> default of every registered invariant's own tolerance; gate/invariants.py installs
# its reader (this module stays light and imports no invariant)
OWN_DEFAULTS: Callable[[], dict[str, Any]] = _no_own


FLAGS = tuple(f.name for f in fields(Tolerances) if f.type in (bool, "bool"))  # on/off, not numbers
_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _flag(name: str, value) -> bool:
    """A flag tolerance from a bool or ``1/0, true/false, yes/no, on/off``; ValueError otherwise."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in _WORDS:
        raise ValueError(f"tolerance {name} must be true or false, got {value!r}")
    return _WORDS[word]
