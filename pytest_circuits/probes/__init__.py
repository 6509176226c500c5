"""The ready-made gate suite: one test per invariant, run once per build (made from the registry).

Run it from an installed package with ``pytest --pyargs pytest_circuits.probes`` (options as
usual: ``--circuits-model``, ``--circuits-builds``, ``--circuits-baselines``), or make it part
of your own suite with one line in a test module::

    from pytest_circuits.probes import *  # noqa: F401,F403
"""

from . import test_registered, test_rung1_weights, test_rung2_knockout, test_rung12_repeat, test_swap

_TESTS = {
    name: test
    for module in (test_rung1_weights, test_rung12_repeat, test_rung2_knockout, test_swap, test_registered)
    for name, test in vars(module).items()
    if name.startswith("test_")
}
globals().update(_TESTS)
__all__ = sorted(_TESTS)
