"""Rung 2, interventions: head knockouts of every build against the baselines."""


def test_knockout_deltas_keep_size(circuits_gate):
    """The key heads' knockout deltas (copy loss rise when zeroed) keep their size."""
    circuits_gate("knockout_deltas")
