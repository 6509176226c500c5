"""The gate suite's tests, made from the invariant registry: one test per invariant, run once per build.

An invariant names its test (`Invariant.suite_test`, default ``test_<name>``) and the module that
holds it (`Invariant.suite_module`, default ``test_registered``). An invariant registered in a
``conftest.py`` (imported before pytest collects the suite) gets its test with no other file
touched; the cross-model ones run together in ``test_base_model_swap``.
"""

from __future__ import annotations

from collections.abc import Callable

DEFAULT_MODULE = "test_registered"


def gate_tests(module: str) -> dict[str, Callable]:
    """The tests of ``module`` (``test_rung1_weights``, ...): test name -> test function."""
    from ..gate.invariants import REGISTRY

    tests: dict[str, Callable] = {}
    for name, invariant in REGISTRY.items():
        if invariant.across_models or (invariant.suite_module or DEFAULT_MODULE) != module:
            continue
        test_name = invariant.suite_test or f"test_{name}"
        tests[test_name] = _gate_test(test_name, name, type(invariant).__doc__ or "", module)
    return tests


def _gate_test(test_name: str, invariant: str, doc: str, module: str) -> Callable:
    def test(circuits_gate) -> None:
        circuits_gate(invariant)

    test.__name__ = test.__qualname__ = test_name
    test.__doc__ = doc
    test.circuits_invariant = invariant  # type: ignore[attr-defined]  # what the plugin's preflight reads
    test.__module__ = f"{__package__}.{module}"
    return test
