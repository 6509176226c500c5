"""Invariants without a module of their own (rung 3's, and those registered in a ``conftest.py``): one gate
test each, once per build; and the case shards of rung 3's audit slice under pytest-xdist."""

from pytest_circuits.probes.registered import DEFAULT_MODULE, gate_tests

globals().update(gate_tests(DEFAULT_MODULE))


def test_audit_shard(circuits_audit_shard):
    """One case shard of rung 3 on a build, measured once for the run (only under pytest-xdist with an
    audit slice of 32 cases or more; otherwise not collected), so another worker may take it; the
    rung-3 gate tests merge the shards into the whole slice's figures."""
    shard = circuits_audit_shard
    assert shard.cases, "a shard measured no case"
    assert all(len(case.chunk_drops) >= 1 for case in shard.cases)
