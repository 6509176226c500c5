"""Rung 1, weights: the OV copying scores of every build against the baselines.

Run: ``pytest probes`` (default model and builds) or
``pytest probes --circuits-model PATH --circuits-builds fp32,bnb-nf4``. The tests come from the
invariant registry (`registered.gate_tests`): copying_heads, kappa_distribution, ov_gain.
"""

from pytest_circuits.probes.registered import gate_tests

globals().update(gate_tests("test_rung1_weights"))
