"""One run's baseline book-keeping: where each build's baseline lives, writing it once per run,
reading it once, the event log the summary reads, and the key heads a screened scan pins.

Its inputs are typed: the settings, the model's name and geometry (read when first needed), the
run's `RecordSource`, the memo that keeps one answer (or failure) per run, and the run folder
shared by pytest-xdist's workers (None in one process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BaselineCorrupt, BaselineError, BaselineMissing
from ..gate.fixes import record_command
from ..gate.invariants import key_heads
from ..options import flag
from ..record.schema import Record, RecordLike
from ..record.store import BaselineStore, geometry_difference, geometry_record, same_geometry
from .record_source import RecordSource

if TYPE_CHECKING:
    from ..gate.change_screen import ChangeScreen
    from ..gate.tolerances import Tolerances
    from ..settings import CircuitsSettings

Memo = Callable[[tuple[Any, ...], Callable[[], Any]], Any]


class RunBaselines:
    """The baselines of one run's model: found, written (once per run), read (once per run) and logged."""

    def __init__(
        self,
        settings: CircuitsSettings,
        model_name: Callable[[], str],
        geometry: Callable[[], Any],
        records: RecordSource,
        memo: Memo,
        run_folder: Callable[[], Any] = lambda: None,
        key_heads_of: Sequence[RecordLike] = (),
        tolerances: Callable[[], Any] = lambda: None,
    ) -> None:
        self.settings = settings  # `CircuitsSettings`
        self._model_name, self._geometry, self.records, self.memo = model_name, geometry, records, memo
        self._run_folder = run_folder
        self._tolerances = tolerances  # the run's `Tolerances` (how many looks a baseline stores)
        self.key_heads_of = tuple(key_heads_of)  # more records whose key heads a screened scan knocks out exactly
        self.events: list[dict[str, Any]] = []  # baseline events: written, compared, missing, corrupt (for the summary)

    @property
    def model_name(self) -> str:
        return self._model_name()

    @cached_property
    def store(self) -> BaselineStore:
        """The baselines folder (`store.BaselineStore`): the one given, else the default one,
        else, for a named model whose baselines ship with the package and the default folder holds
        none of them, the shipped folder (read only: recording writes to the default folder)."""
        from ..model.named import NAMED_MODELS, SHIPPED_BASELINES

        s = self.settings
        store = BaselineStore(s.baselines)
        if s.baselines_given or s.update or s.model not in NAMED_MODELS or store.builds(self.model_name):
            return store
        shipped = BaselineStore(SHIPPED_BASELINES)
        return shipped if shipped.builds(self.model_name) else store

    def path(self, build_name: str) -> Path:
        """Where the baseline of ``build_name`` for this model lives."""
        return self.store.path(self.model_name, build_name)

    def record_command(self, build_name: str) -> str:
        """The shell command that (re)records the baseline of ``build_name``, with every setting it was gated with."""
        s = self.settings
        return record_command(s, str(s.spec(build_name)), s.baselines)

    def write(self, build_name: str) -> Path:
        """Record ``build_name`` (with knockouts) and write its baseline atomically, once per run.

        Under pytest-xdist the write runs once in the run's shared folder (`fsio.RunFolder.once`):
        the first worker that needs the file records and writes it, every other one waits for the
        lock, finds the marker and reads the file (no second load, no second writer).
        """

        def write() -> Path:
            self.store.check_writable(self.path(build_name))  # a path it cannot write ends here, not after the scan
            from .looks import with_looks  # every look of the sequential rule, measured once

            record = with_looks(
                self.records, build_name, self.records.record(build_name, knockout=True), self._tolerances()
            )
            path, written = self.store.write(self.model_name, build_name, record.data, force=self.settings.update_all)
            self.events.append(
                {"event": "written" if written else "unchanged", "recipe": build_name, "path": str(path)}
            )
            return path

        def write_once() -> Path:
            folder = self._run_folder()
            if folder is None:
                return write()
            return Path(folder.once(f"{self.path(build_name).name}.written", write, dump=str, load=Path))

        return Path(self.memo(("written", build_name), write_once))

    def load(self, build_name: str) -> Record:
        """The baseline record of ``build_name``, validated once (`store.read_record`): written first
        under ``update``; a typed BaselineError (`BaselineMissing`, `BaselineCorrupt`) if there is none
        or it is unreadable."""

        def load() -> Record:
            if self.settings.records_baseline(build_name):
                self.write(build_name)
            path = self.path(build_name)
            try:
                record = self.store.read(self.model_name, build_name)
            except BaselineMissing:
                self.events.append({"event": "missing", "recipe": build_name, "path": str(path)})
                raise BaselineMissing(self.missing_message(build_name, path)) from None
            except BaselineCorrupt:
                self.events.append({"event": "corrupt", "recipe": build_name, "path": str(path)})
                raise
            self.events.append({"event": "compared", "recipe": build_name, "path": str(path)})
            return record

        loaded: Record = self.memo(("baseline", build_name), load)
        return loaded

    def missing_message(self, build_name: str, path: Path) -> str:
        """Why ``build_name`` has no baseline, and what to do: gate against a baseline of the same
        geometry in the folder (``--circuits-name``) first, when there is one; recording makes this
        build the reference its later builds are gated against."""
        record = f"record it with: {self.record_command(build_name)} (or add {flag('update')} to this pytest command)"
        try:
            others = same_geometry(path.parent, build_name, self._geometry().__dict__, self.model_name)
        except Exception:  # the model does not resolve: its own error says so
            others = {}
        if not others:
            return f"baseline {path} does not exist; {record}"
        names = ", ".join(p.name for p in others.values())
        return (
            f"baseline {path} does not exist, but {path.parent} holds a baseline of the same geometry ({names}): "
            f"if {self.settings.model} is a build of that model, gate it against it with "
            f"{flag('name')} {next(iter(others))}. Recording instead makes this build the reference every later "
            f"build is gated against, a broken one included; only if it is known good, {record}"
        )

    def key_head_records(self, gated: bool = False) -> list[Record]:
        """The records whose key knockout heads this run knocks out: its baselines (reference and each
        build's own) and `key_heads_of`; a record of another geometry (another base model: compared
        across models, never by label) is left out. ``gated``: only the records a gate compares with,
        `key_heads_of` when given (``circuits gate``'s file), else the baselines."""
        geometry = geometry_record(self._geometry().__dict__)
        records: list[RecordLike] = list(self.key_heads_of)
        for recipe in dict.fromkeys((self.settings.reference, *self.settings.builds)):
            if gated and records:
                break
            try:
                records.append(self.store.read(self.model_name, recipe))
            except BaselineError:
                continue  # missing or corrupt: the gate reports it
        return [Record.of(record) for record in records if not geometry_difference(record, geometry)]

    def key_heads(self, tol: Tolerances) -> list[str]:
        """The key knockout heads of `key_head_records`, which a screened scan always knocks out exactly."""
        heads: set[str] = set()
        for record in self.key_head_records():
            heads.update(key_heads(record, "knockout_delta", tol.top_k, tol.min_delta))
        return sorted(heads)

    def change_screen(self, tol: Tolerances) -> ChangeScreen | None:
        """The change screen of a gate's knockouts (`gate.change_screen`) over `key_head_records`;
        None when ``tol.change_screen`` is 0 (every key head exactly)."""
        from ..gate.change_screen import ChangeScreen

        return ChangeScreen.of(
            lambda: self.key_head_records(gated=True),
            lambda r: key_heads(r, "knockout_delta", tol.top_k, tol.min_delta),
            tol,
        )
