"""One run's measured builds, their records and their baselines, shared by fixtures and the CLI.

Three parts, one job each: `measurement.BuildMeasurement` (the memoised figures of each build, under
the run's `rung2_plan`), `records.record_source` (the records measured, or merged from shard parts)
and `gate.baselines.RunBaselines` (where baselines live, written and read once). `CircuitsSession`
is a `BuildMeasurement` that holds the other two; the gate takes the parts (``session.records``,
``session.baselines``), never the session. Not public API any more (docs/api.md): importing it
from ``pytest_circuits`` warns; ``pytest_circuits.session.CircuitsSession`` keeps working.

Light at import (the plugin may create one in any run): each method imports the layer it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from . import rung2_plan
from .errors import renamed_keywords
from .measurement import BuildMeasurement
from .settings import CircuitsSettings


class CircuitsSession(BuildMeasurement):
    """A run's `BuildMeasurement` with its record source (`records`), baselines (`baselines`) and tolerances."""

    AUTO_SCREEN_HEADS = rung2_plan.AUTO_SCREEN_HEADS
    AUTO_SCREEN_TOP_K = rung2_plan.AUTO_SCREEN_TOP_K
    AUTO_SHARD_HEADS = rung2_plan.AUTO_SHARD_HEADS

    def __init__(self, settings: CircuitsSettings, key_heads_of: Sequence[dict] = ()):
        """``key_heads_of``: records (a gated baseline file) whose key heads a screened scan knocks
        out exactly besides those of the run's baselines."""
        super().__init__(settings, key_heads=self.baseline_key_heads)
        self._key_heads_of = tuple(key_heads_of)
        self._pinned: set[str] = set()

    @cached_property
    def records(self):
        """The run's `gate.record_source.RecordSource` (`records.record_source`: measured or merged)."""
        from .records import record_source

        return record_source(self)

    @cached_property
    def baselines(self):
        """This run's baseline book-keeping (`gate.baselines.RunBaselines`)."""
        from .gate.baselines import RunBaselines

        return RunBaselines(
            self.settings,
            lambda: self.model_name,
            self.preflight,
            self.records,
            self.memo,
            lambda: self.run_folder,
            self._key_heads_of,
            lambda: self.tolerances,
        )

    @cached_property
    def tolerances(self):
        """Gate tolerances: defaults, overridden by ini ``circuits_tol_*`` keys."""
        from .gate.tolerances import Tolerances

        return Tolerances().updated(self.settings.tolerances)

    def baseline_key_heads(self) -> list[str]:
        """The heads a screened scan always knocks out exactly (`RunBaselines.key_heads`)."""
        return sorted(set(self.baselines.key_heads(self.tolerances)) | self._pinned)

    @renamed_keywords(recipe="build_name")
    def record(self, build_name: str, knockout: bool = True, method=None) -> dict:
        """The scan record of one build (`records`), knockouts optional, kappa measured by ``method``
        (default: the settings' `KappaMethod`)."""
        return self.records.record(build_name, knockout, method)

    @renamed_keywords(recipe="build_name")
    def merged_record(self, build_name: str, method=None) -> dict:
        """``--circuits-shard-parts``: the record of ``build_name`` merged from its shard parts."""
        from .records import ShardPartRecords

        return ShardPartRecords(self).record(build_name, method=method)

    @renamed_keywords(recipe="build_name")
    def identity_lines(self, build_name: str) -> list[str]:
        """``"external build q8 = dist/model-Q8_0.gguf (gguf, sha256 ..., tensors Q8_0 x12, F32 x5)"``
        for ``build_name`` and the reference, where they are external builds (gate messages, summary)."""
        from .errors import CircuitsError
        from .model.recipes import describe_identity

        lines = []
        for name in dict.fromkeys((build_name, self.settings.reference)):
            spec = self.settings.spec(name)
            if not (spec.external or spec.kv):
                continue
            try:
                identity = self.load_baseline(name)["build"] if name != build_name else self.records.identity(name)
            except CircuitsError:
                continue  # the gate reports a missing or unreadable reference itself
            line = describe_identity(identity)
            if line:
                lines.append(f"{'reference ' if name != build_name else ''}{line}")
        return lines

    # ------------------------------------------------------------ the baselines' book-keeping, by their older names

    @property
    def store(self):
        return self.baselines.store

    @property
    def events(self) -> list[dict]:
        return self.baselines.events

    @renamed_keywords(recipe="build_name")
    def baseline_path(self, build_name: str) -> Path:
        return self.baselines.path(build_name)

    @renamed_keywords(recipe="build_name")
    def record_command(self, build_name: str) -> str:
        return self.baselines.record_command(build_name)

    @renamed_keywords(recipe="build_name")
    def write_baseline(self, build_name: str) -> Path:
        return self.baselines.write(build_name)

    @renamed_keywords(recipe="build_name")
    def load_baseline(self, build_name: str) -> dict:
        return self.baselines.load(build_name).data  # the record dict, as this (deprecated) API always returned

    @renamed_keywords(recipe="build_name")
    def missing_message(self, build_name: str, path: Path) -> str:
        return self.baselines.missing_message(build_name, path)

    def pin_key_heads(self, heads) -> None:
        """Knock ``heads`` out exactly in every later screened scan (older API; `key_heads_of` instead)."""
        self._pinned.update(heads)
