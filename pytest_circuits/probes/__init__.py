"""The ready-made gate suite: one test per invariant, run once per build.

Run it from an installed package with ``pytest --pyargs pytest_circuits.probes`` (options as
usual: ``--circuits-model``, ``--circuits-builds``, ``--circuits-baselines``), or make it part
of your own suite with one line in a test module::

    from pytest_circuits.probes import *  # noqa: F401,F403
"""

from .test_rung1_weights import test_copying_heads_survive, test_kappa_distribution_not_shifted
from .test_rung2_knockout import test_knockout_deltas_keep_size, test_knockout_shard
from .test_rung12_repeat import test_copy_loss_within_tolerance, test_induction_heads_survive
from .test_swap import test_base_model_swap

__all__ = [
    "test_base_model_swap",
    "test_copy_loss_within_tolerance",
    "test_copying_heads_survive",
    "test_induction_heads_survive",
    "test_kappa_distribution_not_shifted",
    "test_knockout_deltas_keep_size",
    "test_knockout_shard",
]
