"""Rungs 1 and 2, sampled inputs: the random-repeat probe of every build against the baselines."""


def test_copy_loss_within_tolerance(circuits_gate):
    """Copy loss and copy gain (nats) on the seeded repeat sequences stay within tolerance."""
    circuits_gate("copy_loss")


def test_induction_heads_survive(circuits_gate):
    """The top prefix-matching (induction) and previous-token heads keep their scores."""
    circuits_gate("induction_heads")
