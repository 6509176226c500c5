"""One run's loaded builds and figures, computed once and shared by fixtures and the CLI."""

from __future__ import annotations

from functools import cached_property

from .model.builds import LoadedBuild, get_recipe, load_build, resolve_device
from .model.loading import ModelSource, resolve_model
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
        from .model.weights import extract_weights

        return self._memo(f"weights-fold={fold}", recipe, lambda: extract_weights(self.build(recipe).model, fold))

    def ov_spectrum(self, recipe: str):
        """Rung 1: kappa of every head against the rotation null (DataFrame)."""
        from .rungs.kappa import ov_spectrum

        s = self.settings
        return self._memo(
            "ov_spectrum",
            recipe,
            lambda: ov_spectrum(self.weights(recipe), n_rotations=s.n_rotations, q=s.fdr_q, seed=0),
        )

    def repeat_probe(self, recipe: str):
        """Rung 1/2: copy losses and per-head routing scores on the seeded repeat probe."""
        from .rungs.probe import run_repeat_probe

        s = self.settings
        return self._memo(
            "repeat_probe",
            recipe,
            lambda: run_repeat_probe(self.build(recipe), s.probe, batch_size=s.batch_size),
        )

    def head_knockout(self, recipe: str, heads=None):
        """Rung 2: knockout delta of every head on held-out repeat sequences (DataFrame)."""
        from .rungs.knockout import knockout_scan

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
                must_include=self.baseline_key_heads() if s.knockout_screen else (),
                batch_size=s.batch_size,
            ),
        )

    # ------------------------------------------------------------ baselines (record.py, baseline.py)

    def record(self, recipe: str, knockout: bool = True) -> dict:
        """The scan record of one build (`record.build_record`), knockouts optional."""
        from .gate.record import build_record

        if not knockout and ("record-knockout=True", recipe) in self._cache:
            return self._cache[("record-knockout=True", recipe)]
        return self._memo(f"record-knockout={knockout}", recipe, lambda: build_record(self, recipe, knockout))

    def baseline_path(self, recipe: str):
        """Where the baseline of ``recipe`` for this model lives."""
        from .gate.store import baseline_path

        return baseline_path(self.settings.baselines, self.source.name, recipe)

    def record_command(self, recipe: str) -> str:
        """The shell command that (re)records the baseline of ``recipe``."""
        return (
            f"circuits record {self.settings.model} --build {recipe} --baselines {self.settings.baselines}"
        )

    def write_baseline(self, recipe: str):
        """Record ``recipe`` (with knockouts) and write its baseline atomically, once per session."""
        from .gate.store import write_baseline

        def write():
            path = write_baseline(self.baseline_path(recipe), self.record(recipe, knockout=True))
            self.events.append({"event": "written", "recipe": recipe, "path": str(path)})
            return path

        return self._memo("written", recipe, write)

    def load_baseline(self, recipe: str) -> dict:
        """The baseline record of ``recipe``: written first under ``update``; BaselineError if missing/corrupt."""
        from .errors import BaselineError
        from .gate.store import read_baseline

        def load():
            if self.settings.update and (recipe in self.settings.builds or recipe == self.settings.reference):
                self.write_baseline(recipe)
            path = self.baseline_path(recipe)
            if not path.is_file():
                self.events.append({"event": "missing", "recipe": recipe, "path": str(path)})
                raise BaselineError(
                    f"baseline {path} does not exist; record it with: {self.record_command(recipe)} "
                    f"(or pytest --circuits-builds {recipe} --circuits-update)"
                )
            try:
                record = read_baseline(path)
            except BaselineError:
                self.events.append({"event": "corrupt", "recipe": recipe, "path": str(path)})
                raise
            self.events.append({"event": "compared", "recipe": recipe, "path": str(path)})
            return record

        key = ("baseline", recipe)
        if key not in self._cache:
            try:
                self._cache[key] = load()
            except Exception as error:  # remember the failure: one message per session, no retries
                self._cache[key] = error
        value = self._cache[key]
        if isinstance(value, Exception):
            raise value
        return value

    def baseline_key_heads(self) -> list[str]:
        """The reference baseline's key knockout heads, which a screened scan always runs exactly."""
        from .errors import BaselineError
        from .gate.invariants import key_heads
        from .gate.store import read_baseline

        heads: set[str] = set()
        for recipe in dict.fromkeys((self.settings.reference, *self.settings.builds)):
            path = self.baseline_path(recipe)
            if path.is_file():
                try:
                    record = read_baseline(path)
                except BaselineError:
                    continue  # the gate reports the corrupt file
                tol = self.tolerances
                heads.update(key_heads(record, "knockout_delta", tol.top_k, tol.min_delta))
        return sorted(heads)

    @cached_property
    def events(self) -> list[dict]:
        """Baseline events of this run: written, compared, missing, corrupt (for the summary)."""
        return []

    @cached_property
    def tolerances(self):
        """Gate tolerances: defaults, overridden by ini ``circuits_tol_*`` keys."""
        from .gate.invariants import Tolerances

        return Tolerances().updated(self.settings.tolerances)
