"""One run's baseline book-keeping: where each build's baseline lives, writing it once per run,
reading it once, the event log the summary reads, and the key heads a screened scan pins.

``session`` (duck-typed, like `verdict.gate_build`'s) provides ``settings``, ``model_name``,
``preflight()``, ``record(recipe, knockout)``, ``memo(key, compute)`` and ``run_folder``.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from ..errors import BaselineCorrupt, BaselineError, BaselineMissing
from ..options import flag
from .fixes import record_command
from .invariants import key_heads
from .store import BaselineStore, geometry_difference, geometry_record, same_geometry


class RunBaselines:
    """The baselines of one run's model: found, written (once per run), read (once per run) and logged."""

    def __init__(self, session) -> None:
        self.session = session
        self.events: list[dict] = []  # baseline events: written, compared, missing, corrupt (for the summary)
        self.pinned_key_heads: set[str] = set()  # always knocked out exactly (e.g. a baseline file's key heads)

    @cached_property
    def store(self) -> BaselineStore:
        """The baselines folder (`store.BaselineStore`): the one given, else the default one,
        else, for a named model whose baselines ship with the package and the default folder holds
        none of them, the shipped folder (read only: recording writes to the default folder)."""
        from ..model.named import NAMED_MODELS, SHIPPED_BASELINES

        s = self.session.settings
        store = BaselineStore(s.baselines)
        if s.baselines_given or s.update or s.model not in NAMED_MODELS or store.builds(self.session.model_name):
            return store
        shipped = BaselineStore(SHIPPED_BASELINES)
        return shipped if shipped.builds(self.session.model_name) else store

    def path(self, recipe: str) -> Path:
        """Where the baseline of ``recipe`` for this model lives."""
        return self.store.path(self.session.model_name, recipe)

    def record_command(self, recipe: str) -> str:
        """The shell command that (re)records the baseline of ``recipe``, with every setting it was gated with."""
        s = self.session.settings
        return record_command(s, str(s.spec(recipe)), s.baselines)

    def write(self, recipe: str) -> Path:
        """Record ``recipe`` (with knockouts) and write its baseline atomically, once per run.

        Under pytest-xdist the write runs once in the run's shared folder (`fsio.RunFolder.once`):
        the first worker that needs the file records and writes it, every other one waits for the
        lock, finds the marker and reads the file (no second load, no second writer).
        """
        session = self.session

        def write() -> Path:
            self.store.check_writable(self.path(recipe))  # a path it cannot write ends here, not after the scan
            from .looks import with_looks  # every look of the sequential rule, measured once (gate/looks.py)

            record = with_looks(session, recipe, session.record(recipe, knockout=True), session.tolerances.looks)
            path, written = self.store.write(session.model_name, recipe, record, force=session.settings.update_all)
            self.events.append({"event": "written" if written else "unchanged", "recipe": recipe, "path": str(path)})
            return path

        def write_once() -> Path:
            if session.run_folder is None:
                return write()
            return session.run_folder.once(f"{self.path(recipe).name}.written", write, dump=str, load=Path)

        return session.memo(("written", recipe), write_once)

    def load(self, recipe: str) -> dict:
        """The baseline record of ``recipe``: written first under ``update``; a typed BaselineError
        (`BaselineMissing`, `BaselineCorrupt`) if there is none or it is unreadable."""
        session = self.session

        def load() -> dict:
            s = session.settings
            if s.update and (recipe in s.builds or recipe == s.reference):
                self.write(recipe)
            path = self.path(recipe)
            try:
                record = self.store.read(session.model_name, recipe)
            except BaselineMissing:
                self.events.append({"event": "missing", "recipe": recipe, "path": str(path)})
                raise BaselineMissing(self.missing_message(recipe, path)) from None
            except BaselineCorrupt:
                self.events.append({"event": "corrupt", "recipe": recipe, "path": str(path)})
                raise
            self.events.append({"event": "compared", "recipe": recipe, "path": str(path)})
            return record

        return session.memo(("baseline", recipe), load)

    def missing_message(self, recipe: str, path: Path) -> str:
        """Why ``recipe`` has no baseline, and what to do: gate against a baseline of the same
        geometry in the folder (``--circuits-name``) first, when there is one; recording makes this
        build the reference its later builds are gated against."""
        session = self.session
        record = f"record it with: {self.record_command(recipe)} (or add {flag('update')} to this pytest command)"
        try:
            others = same_geometry(path.parent, recipe, session.preflight().__dict__, session.model_name)
        except Exception:  # the model does not resolve: its own error says so
            others = {}
        if not others:
            return f"baseline {path} does not exist; {record}"
        names = ", ".join(p.name for p in others.values())
        return (
            f"baseline {path} does not exist, but {path.parent} holds a baseline of the same geometry ({names}): "
            f"if {session.settings.model} is a build of that model, gate it against it with "
            f"{flag('name')} {next(iter(others))}. Recording instead makes this build the reference every later "
            f"build is gated against, a broken one included; only if it is known good, {record}"
        )

    def key_heads(self, tol) -> list[str]:
        """The key knockout heads of this run's baselines (reference and each build's own) and the
        pinned ones, which a screened scan always knocks out exactly."""
        session = self.session
        heads: set[str] = set(self.pinned_key_heads)
        geometry = geometry_record(session.preflight().__dict__)
        for recipe in dict.fromkeys((session.settings.reference, *session.settings.builds)):
            try:
                record = self.store.read(session.model_name, recipe)
            except BaselineError:
                continue  # missing or corrupt: the gate reports it
            if geometry_difference(record, geometry):
                continue  # another base model's heads: compared across models, never by label
            heads.update(key_heads(record, "knockout_delta", tol.top_k, tol.min_delta))
        return sorted(heads)
