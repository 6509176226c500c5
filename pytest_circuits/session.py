"""One run's loaded builds and figures, computed once and shared by fixtures and the CLI."""

from __future__ import annotations

from functools import cached_property

from .builds import LoadedBuild, get_recipe, load_build, resolve_device
from .loading import ModelSource, resolve_model
from .settings import CircuitsSettings


class CircuitsSession:
    """Memoises, per build recipe: the loaded build and its rung 1, probe and knockout figures."""

    def __init__(self, settings: CircuitsSettings):
        self.settings = settings
        self._cache: dict[tuple[str, str], object] = {}

    def _memo(self, kind: str, recipe: str, compute):
        key = (kind, recipe)
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    @cached_property
    def source(self) -> ModelSource:
        """The model's weights folder, resolved once, offline."""
        return resolve_model(self.settings.model)

    @cached_property
    def device(self):
        return resolve_device(self.settings.device)

    def build(self, recipe: str) -> LoadedBuild:
        """The loaded build ``recipe`` of the session's model."""
        get_recipe(recipe)
        return self._memo(
            "build",
            recipe,
            lambda: load_build(self.source, recipe, self.device, self.settings.trust_remote_code),
        )

    def weights(self, recipe: str, fold: bool = True):
        """Per-head weights of a build (float32, dequantized, folded by default)."""
        from .weights import extract_weights

        return self._memo(f"weights-fold={fold}", recipe, lambda: extract_weights(self.build(recipe).model, fold))

    def ov_spectrum(self, recipe: str):
        """Rung 1: kappa of every head against the rotation null (DataFrame)."""
        from .kappa import ov_spectrum

        s = self.settings
        return self._memo(
            "ov_spectrum",
            recipe,
            lambda: ov_spectrum(self.weights(recipe), n_rotations=s.n_rotations, q=s.fdr_q, seed=0),
        )

    def repeat_probe(self, recipe: str):
        """Rung 1/2: copy losses and per-head routing scores on the seeded repeat probe."""
        from .probe import run_repeat_probe

        s = self.settings
        return self._memo(
            "repeat_probe",
            recipe,
            lambda: run_repeat_probe(self.build(recipe), s.probe, batch_size=s.batch_size),
        )

    def head_knockout(self, recipe: str, heads=None):
        """Rung 2: knockout delta of every head on held-out repeat sequences (DataFrame)."""
        from .knockout import knockout_scan

        s = self.settings
        return self._memo(
            "head_knockout",
            recipe,
            lambda: knockout_scan(
                self.build(recipe),
                s.knockout_probe,
                mode=s.knockout_mode,
                heads=heads,
                screen_top_k=s.knockout_screen,
                batch_size=s.batch_size,
            ),
        )
