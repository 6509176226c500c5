"""The rung-2 plan of one run: which heads are knocked out exactly (every one, or a screen's top K
plus the baselines' key heads) and in how many layer shards, decided from the settings and the
model's geometry alone (a value object; nothing here measures)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CircuitsError
from ..options import flag
from ..settings import CircuitsSettings

AUTO_SCREEN_HEADS = 300  # above this many heads the default rung-2 plan screens (SmolLM2-135M: 270, exact)
AUTO_SCREEN_TOP_K = 12  # ... and knocks out the screen's top 12 exactly, plus the baselines' key heads
AUTO_SHARD_HEADS = 1024  # under xdist, models with this many heads or more shard their scan over the workers


@dataclass(frozen=True)
class Rung2Plan:
    """One knockout scan's plan: ``top_k`` (None: every head exactly), the heads always knocked out
    exactly when screening (``must_include``), and whether the plan was chosen by size (then said)."""

    top_k: int | None
    must_include: tuple[str, ...] = ()
    by_size: bool = False

    @property
    def screened(self) -> bool:
        return self.top_k is not None


def screen_top_k(settings: CircuitsSettings, geometry: Callable) -> int | None:
    """Exact knockouts of the screen's top K heads (and the baselines' key heads), or None for every
    head exactly. ``--knockout-screen K`` and ``--knockout-full`` choose; by default a model of more
    than `AUTO_SCREEN_HEADS` heads screens (its full exact scan is hours on a CPU: docs/scale.md), a
    smaller one is scanned exactly. ``geometry()``: the model's `Geometry` (read only when needed)."""
    s = settings
    if s.knockout_screen is not None and s.knockout_full:
        raise CircuitsError(
            f"{flag('knockout-full')} (every head exactly) and {flag('knockout-screen')} {s.knockout_screen} "
            "contradict each other; give one"
        )
    if s.knockout_screen is not None or s.knockout_full:
        return s.knockout_screen
    g = geometry()
    return AUTO_SCREEN_TOP_K if g.n_layers * g.n_heads > AUTO_SCREEN_HEADS else None


def plan(settings: CircuitsSettings, geometry: Callable, key_heads: Callable[[], list[str]]) -> Rung2Plan:
    """The plan of a knockout scan now: ``key_heads()`` is read only when the scan screens."""
    top_k = screen_top_k(settings, geometry)
    must_include = tuple(key_heads()) if top_k is not None else ()
    return Rung2Plan(top_k, must_include, by_size=top_k is not None and settings.knockout_screen is None)


def shard_count(settings: CircuitsSettings, workers: int, geometry: Callable) -> int:
    """Layer shards of a full knockout scan: ``--circuits-knockout-shards`` (at most the layer count), else
    the worker count under pytest-xdist for a model of `AUTO_SHARD_HEADS` heads or more, else one; one
    when the knockouts come from shard parts (``--circuits-shard-parts``: nothing is measured)."""
    if settings.shard_parts is not None:
        return 1
    if settings.knockout_shards is not None:  # at most one shard per layer (4096 on 2 layers: 2)
        try:
            return max(1, min(settings.knockout_shards, geometry().n_layers))
        except Exception:  # the model cannot be gated: its tests say why
            return 1
    if workers <= 1:
        return 1
    try:
        g = geometry()
    except Exception:  # the model cannot be gated: its tests say why
        return 1
    return workers if g.n_layers * g.n_heads >= AUTO_SHARD_HEADS else 1


def screen_variant(settings: CircuitsSettings):
    """The screen's knobs (`rungs.screen.ScreenVariant`) from the settings."""
    from ..rungs.screen import ScreenVariant

    return ScreenVariant(
        sequences=settings.knockout_screen_sequences,
        qk_top=settings.knockout_screen_qk_top,
        grad_drop_layers=settings.knockout_screen_grad_drop_layers,
        ablation=settings.knockout_screen_ablation,
    )
