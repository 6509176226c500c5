"""Rung 2, interventions: head knockouts of every build against the baselines."""


def test_knockout_deltas_keep_size(circuits_gate):
    """The key heads' knockout deltas (copy loss rise when zeroed) keep their size."""
    circuits_gate("knockout_deltas")


def test_knockout_shard(circuits_knockout_shard):
    """One layer shard of a build's knockout scan, measured once for the run (only with
    ``--circuits-knockout-shards K``, or automatic under pytest-xdist for big models; otherwise
    deselected); the knockout gate merges the shards into the unsharded scan."""
    shard = circuits_knockout_shard
    mine = shard["layer"].isin(shard.attrs["layers"])
    assert shard.loc[~mine, "knockout_delta"].isna().all(), "a shard measured heads outside its layers"
    assert shard.loc[mine, "knockout_delta"].notna().any() or not shard.attrs["exact_heads"], "nothing measured"
