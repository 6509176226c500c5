"""Shared fixtures of the plugin's own tests: tiny models built locally, never downloaded."""

from __future__ import annotations

import pytest

from pytest_circuits.testing import TINY_FAMILIES, requires_embedded_model, requires_smollm2, save_tiny_model

pytest_plugins = ["pytester"]

FAMILIES = TINY_FAMILIES
needs_smollm2 = requires_smollm2()
needs_embedded = requires_embedded_model()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """``tiny_folder(family, seed=0)``: a saved tiny random model folder, built once per session."""
    made = {}

    def make(family: str, seed: int = 0):
        key = (family, seed)
        if key not in made:
            made[key] = save_tiny_model(family, tmp_path_factory.mktemp(f"{family}-{seed}"), seed=seed)
        return made[key]

    return make
