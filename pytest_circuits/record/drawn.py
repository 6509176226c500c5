"""The report's view of a record (`Drawn`): lenient where the gate is strict, since the report draws
partial records too (a scan without knockouts or eigenvalues, a hand-built one) as far as they go."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import figures
from .schema import Record, RecordLike


class DrawnHead:
    """One head row as the report draws it: its label and cell, and each figure by name (None where absent)."""

    def __init__(self, row: Mapping[str, Any], layer: int, head_index: int) -> None:
        self._row, self.layer, self.head_index = row, layer, head_index
        self.head: Any = row.get("head")

    def figure(self, name: str) -> Any:
        """The row's ``name`` (``kappa``, ``copying``, ...); None where the row lacks it."""
        return self._row.get(name)


class Drawn:
    """A lenient typed view of a record for drawing (`drawn_record`): the report reads a partial record
    (a scan without knockouts or eigenvalues, a hand-built one) as far as it goes, so nothing is
    required and a missing part reads as None; a `Record` is drawn the same way, from its `data`."""

    def __init__(self, record: Mapping[str, Any]) -> None:
        self._d = record

    def info(self, *path: str) -> Any:
        """The value at ``path`` (``info("model", "geometry", "n_layers")``); None where any step is missing."""
        value: Any = self._d
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        return value

    def figure(self, name: str) -> Any:
        """A top-level figure or series (``copy_loss``, ``position_loss``, ``eigenvalues``); None without."""
        return self._d.get(name)

    @property
    def build_name(self) -> str:
        """The build's name (``build.recipe``; ``"build"`` if unnamed)."""
        return str(self.info("build", "recipe") or "build")

    @property
    def audit_drops(self) -> list[tuple[str, list[float]]]:
        """Rung 3's drops as drawn: ``(case id, chunk_drops)`` of each case of the ``audit`` section, in
        its order; empty without one."""
        cases = self.info("audit", "cases") or []
        return [
            (str(c.get("id")), [float(d) for d in c.get("chunk_drops") or []]) for c in cases if isinstance(c, Mapping)
        ]

    @property
    def heads(self) -> list[DrawnHead]:
        """The head rows in model order (L0H0, L0H1, ..., L1H0, ...); a row without its cell reads it from its label."""
        rows = []
        for row in self._d.get("heads") or []:
            cell: Any = (row.get("layer"), row.get("head_index"))
            if None in cell:
                cell = figures.parse_label(row.get("head", "")) or cell
            rows.append((row, cell))
        return [
            DrawnHead(row, int(c[0]), int(c[1]))
            for row, c in sorted(rows, key=lambda rc: (int(rc[1][0]), int(rc[1][1])))
        ]


def drawn_record(record: RecordLike | Drawn) -> Drawn:
    """The `Drawn` view of a record dict, a `Record` or a view."""
    if isinstance(record, Drawn):
        return record
    return Drawn(record.data if isinstance(record, Record) else record)
