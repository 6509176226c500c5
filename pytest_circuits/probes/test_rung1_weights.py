"""Rung 1, weights: the OV copying scores of every build against the baselines.

Run: ``pytest probes`` (default model and builds) or
``pytest probes --circuits-model PATH --circuits-builds fp32,bnb-nf4``.
"""


def test_copying_heads_survive(circuits_gate):
    """Per head: kappa and kappa_trace of copying/suppression heads, kappa_trace of all; rank order of kappa."""
    circuits_gate("copying_heads")


def test_kappa_distribution_not_shifted(circuits_gate):
    """The mean z-score of kappa (and kappa_trace) against the rotation null does not shift."""
    circuits_gate("kappa_distribution")
