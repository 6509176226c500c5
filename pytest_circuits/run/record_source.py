"""What the gate reads a build's figures from: a `RecordSource` (typed, so gate functions take it
instead of a session). The front ends pass one of `pytest_circuits.run.records`: the build measured
(`MeasuredRecords`) or the record merged from shard parts (`ShardPartRecords`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..record.schema import Record


class RecordSource(Protocol):
    """The scan records of one run's builds."""

    def record(self, build_name: str, knockout: bool = True, method: Any = None, key_heads: bool = False) -> Record:
        """The scan record of build ``build_name``, knockouts optional, kappa measured by ``method``
        (a `KappaMethod`; None: the run's). ``key_heads``: the knockouts may be of the run's key heads
        only (the baselines', what `knockout_deltas` compares): the full record when it is measured
        already, when the run records the build, or with ``--knockout-full``; a merge is what it is."""
        ...

    def stand_in(self) -> dict[str, Any]:
        """A record holding only the model's geometry and the run's probe settings, before any figure
        is measured (what `store.compatibility` refuses another probe on)."""
        ...

    def look(
        self, build_name: str, k: int, probe_seed: int, knockout_seed: int, heads: Sequence[str], mode: str | None
    ) -> dict[str, Any] | None:
        """Look ``k`` of the sequential rule (`record.looks`) of build ``build_name``: the probe's
        per-sequence figures on ``probe_seed`` and, with ``heads``, their exact knockout deltas
        (``mode``) on ``knockout_seed``; None where no build is measured (merged shard parts)."""
        ...

    def identity(self, build_name: str) -> dict[str, Any]:
        """The build identity of ``build_name`` (`BuildIdentity.as_dict`)."""
        ...
