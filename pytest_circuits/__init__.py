"""pytest-circuits: gate model builds on mechanistic invariants of their attention heads.

The package is light to import (the pytest plugin loads it in every run): the names below
load their layer on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {  # the supported names (docs/api.md), each loaded from its module on first use
    # loading a model and its builds
    "ModelSource": "model.loading",
    "resolve_model": "model.loading",
    "RECIPES": "model.recipes",
    "BuildSpec": "model.recipes",
    "parse_builds": "model.recipes",
    "parse_build_specs": "model.recipes",
    "BuildIdentity": "model.builds",
    "LoadedBuild": "model.builds",
    "load_build": "model.builds",
    "load_external_build": "model.external",
    "write_gguf": "model.gguf_quant",
    "FAMILIES": "model.families",
    "Family": "model.families",
    "Geometry": "model.families",
    "ModelWeights": "model.weights",
    "extract_weights": "model.weights",
    # scanning: one run's settings and every figure of its builds
    "CircuitsSettings": "settings",
    "RepeatSettings": "rungs.repeat_settings",
    "build_settings": "settings",
    "RepeatProbe": "rungs.probe",
    "ov_spectrum": "rungs.kappa",
    "run_repeat_probe": "rungs.probe",
    "knockout_scan": "rungs.knockout",
    # the gate, its fixture's type and its extension points
    "CircuitsGate": "plugin.fixture_types",
    "Comparison": "gate.invariants",
    "Invariant": "gate.invariants",
    "Row": "gate.invariants",
    "register": "gate.invariants",
    "within": "gate.invariants",
    "Tolerances": "gate.tolerances",
    # assertions for users' own tests
    "assert_copying_heads_preserved": "assertions",
    "assert_kappa_close": "assertions",
    "assert_kappa_distribution_unshifted": "assertions",
    # errors
    "BaselineError": "errors",
    "CircuitsError": "errors",
    "ModelLoadError": "errors",
    "RecipeError": "errors",
    "UnknownFamilyError": "errors",
}
__all__ = sorted(_LAZY)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'pytest_circuits' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    return getattr(module, name)
