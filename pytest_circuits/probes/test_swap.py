"""A base-model swap: every build against the baseline of the model it replaces.

Heads do not correspond across two base models, so this one test per build gates the
model-level swap invariants together (copy behaviour, induction heads, kappa shares and
distribution, knockout size and concentration; docs/definitions.md, "Across base models").
It runs when ``--circuits-swap-baseline FILE`` names the replaced model's baseline, or when
the reference baseline is of another geometry (a model swapped under the same name);
otherwise it is skipped, once per build, saying so. The per-head tests of the other modules
are skipped against another model's baseline, never passed.
"""


def test_base_model_swap(circuits_gate):
    """Copy loss and gain, induction heads, kappa shares and W1 distance, knockouts: against the replaced model."""
    from pytest_circuits.gate.invariants import across_models

    circuits_gate(*across_models())
