"""One run's memo and its model: the source, the device, the preflight, each build loaded once, and a
failure remembered (`LoadedBuilds.memo`). What is measured of a build is `measure.BuildMeasurement`'s.

Light at import (the plugin may create one in any run): each method imports the layer it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from ..progress import stderr_line
from ..settings import CircuitsSettings


class LoadedBuilds:
    """The memo of one run, its model (source, device, preflight) and each build loaded once."""

    NOT_FIGURES = ("preflight", "build", "written", "baseline")  # memo entries that outlive a weight edit

    def __init__(self, settings: CircuitsSettings):
        self.settings = settings
        self._cache: dict[tuple, Any] = {}
        self.loads: list[dict] = []  # {"recipe", "worker", "for"}: each build this process loaded
        self.worker: str | None = None  # the pytest-xdist worker id (gw0, ...), None in a plain run
        # the folder every process of one run shares (pytest-xdist): file locks, written-once markers,
        # knockout shards; None: one process, nothing to share
        self.shared_dir: Path | None = None
        self.workers = 1  # processes of this run (pytest-xdist's worker count)
        self.loading_for: str | None = None  # why a build is being loaded (a knockout shard), for the load count
        self.progress_write: Callable[[str], None] | None = None  # where long scans report (None: stderr)

    def memo(self, key: tuple, compute) -> Any:
        """``compute()`` once under ``key``. The one memo rule: a failure is remembered too and raised
        again (one message per run, no retries: a build that cannot load, or a baseline that is missing,
        is not loaded or logged a second time by every test that needs it)."""
        if key not in self._cache:
            try:
                self._cache[key] = compute()
            except Exception as error:
                self._cache[key] = _Failed(error)
        value = self._cache[key]
        if isinstance(value, _Failed):
            raise value.error
        return value

    def memoised(self, key: tuple) -> Any:
        """What ``key`` holds when it was computed without failing, else None."""
        value = self._cache.get(key)
        return None if isinstance(value, _Failed) else value

    def forget_figures(self, build_name: str | None = None) -> None:
        """Drop the figures measured of ``build_name`` (None: of every build), keeping the loaded build:
        its weights were edited in place, or the probe settings changed (`pytest_circuits.run.sensitivity`).
        Every memo entry but `NOT_FIGURES` is a figure, so one added later is never kept stale."""
        self._cache = {
            k: v for k, v in self._cache.items() if k[0] in self.NOT_FIGURES or build_name not in (None, k[1])
        }

    @cached_property
    def source(self):
        """The model's weights folder (`model.loading.ModelSource`), resolved once, offline."""
        from ..model.loading import resolve_model

        return resolve_model(self.settings.model)

    @property
    def model_name(self) -> str:
        """The model's name in baseline file names: ``settings.name``, else the source's."""
        return self.settings.name or self.source.name

    @cached_property
    def device(self):
        from ..model.builds import resolve_device

        return resolve_device(self.settings.device, self.worker)

    def preflight(self):
        """The model's `Geometry`, its probe settings checked before any figure is computed
        (`measure_steps.preflight`: config and tokenizer only, seconds, not a scan)."""
        from .steps import preflight

        return self.memo(("preflight",), lambda: preflight(self.settings, self.source, str(self.device)))

    def build(self, build_name: str):
        """The loaded build ``build_name`` (`model.builds.LoadedBuild`): a recipe, or the NAME of an
        external build (``NAME=PATH``), with its KV cache when the build names one."""
        from .steps import load_spec

        spec = self.settings.spec(build_name)
        self.preflight()

        def load():
            with self.phase(f"loading {self.model_name}:{build_name}"):
                build = load_spec(self.settings, self.source, spec, self.device)
            self.loads.append({"recipe": build_name, "worker": self.worker, "for": self.loading_for})
            return build

        return self.memo(("build", build_name), load)

    def weights(self, build_name: str, fold: bool = True):
        """Per-head weights of a build (float32, dequantized, folded by default)."""
        from ..model.weights import extract_weights

        return self.memo(("weights", build_name, fold), lambda: extract_weights(self.build(build_name).model, fold))

    def say(self, line: str) -> None:
        """One line to the run's progress writer (pytest's terminal), else to stderr."""
        (self.progress_write or stderr_line)(line)

    def phase(self, label: str):
        """A heartbeat line every few seconds while a long step runs (`progress.phase`)."""
        from ..progress import phase

        return phase(label, self.progress_write)

    @property
    def run_folder(self):
        """The run's shared folder (`fsio.RunFolder`) under pytest-xdist, else None."""
        from ..fsio import RunFolder

        return None if self.shared_dir is None else RunFolder(self.shared_dir)


class _Failed:
    """A memoised failure (`LoadedBuilds.memo`)."""

    def __init__(self, error: Exception):
        self.error = error
