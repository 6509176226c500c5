"""Rung 2, interventions: head knockouts of every build against the baselines.

The gate test comes from the invariant registry (`registered.gate_tests`): knockout_deltas.
"""

from pytest_circuits.probes.registered import gate_tests

globals().update(gate_tests("test_rung2_knockout"))


def test_knockout_shard(circuits_knockout_shard):
    """One layer shard of a build's knockout scan, measured once for the run (only with
    ``--circuits-knockout-shards K``, or automatic under pytest-xdist for big models; otherwise not
    collected); the knockout gate merges the shards into the unsharded scan. In a shard job
    (``--circuits-shard I/K``) only shard I runs, and writes its part to ``--circuits-shard-out``."""
    shard = circuits_knockout_shard
    mine = shard["layer"].isin(shard.attrs["layers"])
    assert shard.loc[~mine, "knockout_delta"].isna().all(), "a shard measured heads outside its layers"
    assert shard.loc[mine, "knockout_delta"].notna().any() or not shard.attrs["exact_heads"], "nothing measured"
