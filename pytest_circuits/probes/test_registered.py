"""Invariants registered outside the package (a ``conftest.py``): one gate test each, once per build."""

from pytest_circuits.probes.registered import DEFAULT_MODULE, gate_tests

globals().update(gate_tests(DEFAULT_MODULE))
