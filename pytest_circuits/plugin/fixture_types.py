"""What the ``circuits_gate`` fixture returns: a typed object with documented methods.

Light (the plugin imports it in every run): the gate itself loads on the first call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ..gate.check import GateOutcome


class CircuitsGate:
    """Gate the test's build on named invariants: ``circuits_gate("copying_heads")``.

    Each invariant is compared against the reference build's baseline and the build's own
    (a cross-model invariant: against the baseline of the model it replaces), with the test's
    tolerances (defaults < ini ``circuits_tol_*`` < ``@pytest.mark.circuits_tolerance``).
    """

    def __init__(self, gate_one: Callable[[str], GateOutcome]):
        self._gate_one = gate_one

    def outcome(self, *invariants: str) -> GateOutcome:
        """The merged verdict of ``invariants`` without failing or skipping the test."""
        from ..gate.check import GateOutcome

        return GateOutcome.merged(self._gate_one(name) for name in invariants)

    def check(self, *invariants: str) -> GateOutcome:
        """Fail the test with the table of heads and numbers that moved; skip it (with the reason)
        when the baseline model has none of the mechanism or the pairing does not compare it.
        Several invariants make one verdict; every result also goes to the terminal summary and
        the ``--circuits-report``. Returns the outcome when the gate held."""
        outcome = self.outcome(*invariants)
        if outcome.skipped:
            pytest.skip(outcome.message())
        if not outcome.passed:
            pytest.fail(outcome.message() or f"{', '.join(invariants)}: nothing was compared", pytrace=False)
        return outcome

    __call__ = check
