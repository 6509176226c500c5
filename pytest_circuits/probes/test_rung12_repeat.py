"""Rungs 1 and 2, sampled inputs: the random-repeat probe of every build against the baselines.

The tests come from the invariant registry (`registered.gate_tests`): copy_loss, induction_heads.
"""

from pytest_circuits.probes.registered import gate_tests

globals().update(gate_tests("test_rung12_repeat"))
