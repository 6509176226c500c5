"""One run, composed of parts that each do one job (docs/architecture.md, "One run"): its settings
(build specs parsed once, `settings.CircuitsSettings`), the builds loaded (`loaded.LoadedBuilds`:
the memo, the source, each build once), what is measured of them (`measure.BuildMeasurement`), the
records (`records`: measured, or merged from shard parts), the baselines (`baselines.RunBaselines`)
and the tolerances. The front ends (the pytest plugin, ``circuits``) make one `Run` and reach the
gate through `flow`, which takes the parts, never the run.

Light at import (the plugin may create one in any run): each part imports the layer it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..settings import CircuitsSettings
from .loaded import LoadedBuilds
from .measure import BuildMeasurement

if TYPE_CHECKING:
    from ..gate.change_screen import ChangeScreen
    from ..gate.tolerances import Tolerances
    from ..record.schema import RecordLike
    from .baselines import RunBaselines
    from .record_source import RecordSource


class Run:
    """One run's parts: ``settings``, ``loaded`` (builds), ``measured`` (figures), ``records``,
    ``baselines`` and ``tolerances``."""

    def __init__(self, settings: CircuitsSettings, key_heads_of: Sequence[RecordLike] = ()):
        """``key_heads_of``: records (a gated baseline file) whose key heads a screened scan knocks
        out exactly besides those of the run's baselines."""
        self.loaded = LoadedBuilds(settings)
        self.measured = BuildMeasurement(self.loaded, key_heads=self.key_heads, change_screen=self.change_screen)
        self._key_heads_of = tuple(key_heads_of)
        self._pinned: set[str] = set()

    @property
    def settings(self) -> CircuitsSettings:
        """The run's settings (held once, by ``loaded``; `sensitivity.with_seeds` points them at other sequences)."""
        return self.loaded.settings

    @cached_property
    def records(self) -> RecordSource:
        """The run's `run.record_source.RecordSource` (`records.record_source`: measured or merged)."""
        from .records import record_source

        return record_source(self.measured)

    @cached_property
    def baselines(self) -> RunBaselines:
        """This run's baseline book-keeping (`baselines.RunBaselines`)."""
        from .baselines import RunBaselines

        loaded = self.loaded
        return RunBaselines(
            self.settings,
            lambda: loaded.model_name,
            loaded.preflight,
            self.records,
            loaded.memo,
            lambda: loaded.run_folder,
            self._key_heads_of,
            lambda: self.tolerances,
        )

    @cached_property
    def tolerances(self) -> Tolerances:
        """Gate tolerances: defaults, overridden by ini ``circuits_tol_*`` keys (or ``--tol``)."""
        from ..gate.tolerances import Tolerances

        return Tolerances().updated(self.settings.tolerances)

    def key_heads(self) -> list[str]:
        """The heads a screened scan always knocks out exactly: the baselines' (`RunBaselines.key_heads`)
        and those pinned (`pin_key_heads`)."""
        return sorted(set(self.baselines.key_heads(self.tolerances)) | self._pinned)

    def change_screen(self) -> ChangeScreen | None:
        """The rule that picks which key heads a gate knocks out exactly (`RunBaselines.change_screen`;
        None: every one)."""
        return self.baselines.change_screen(self.tolerances)

    def pin_key_heads(self, heads: Sequence[str]) -> None:
        """Knock ``heads`` out exactly in every later screened scan (`circuits sensitivity`'s damaged heads)."""
        self._pinned.update(heads)

    def identity_lines(self, build_name: str) -> list[str]:
        """``"external build q8 = dist/model-Q8_0.gguf (gguf, sha256 ..., tensors Q8_0 x12, F32 x5)"``
        for ``build_name`` and the reference, where they are external builds or serve a KV cache (gate
        messages, summary)."""
        from ..errors import CircuitsError
        from ..model.recipes import describe_identity

        lines = []
        for name in dict.fromkeys((build_name, self.settings.reference)):
            spec = self.settings.spec(name)
            if not (spec.external or spec.kv):
                continue
            try:
                identity: dict[str, Any] = (
                    self.baselines.load(name).build.model_dump(exclude_none=True)
                    if name != build_name
                    else self.records.identity(name)
                )
            except CircuitsError:
                continue  # the gate reports a missing or unreadable reference itself
            line = describe_identity(identity)
            if line:
                lines.append(f"{'reference ' if name != build_name else ''}{line}")
        return lines
