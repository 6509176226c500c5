"""pytest-circuits: gate model builds on mechanistic invariants of their attention heads.

The package is light to import (the pytest plugin loads it in every run): the names below
load their layer on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "RECIPES": "model.recipes",
    "BuildIdentity": "model.builds",
    "LoadedBuild": "model.builds",
    "load_build": "model.builds",
    "parse_builds": "model.recipes",
    "BuildSpec": "model.recipes",
    "parse_build_specs": "model.recipes",
    "load_external_build": "model.external",
    "write_gguf": "model.gguf_quant",
    "FAMILIES": "model.families",
    "Geometry": "model.families",
    "ModelSource": "model.loading",
    "resolve_model": "model.loading",
    "ModelWeights": "model.weights",
    "extract_weights": "model.weights",
    "BaselineError": "errors",
    "CircuitsError": "errors",
    "ModelLoadError": "errors",
    "RecipeError": "errors",
    "UnknownFamilyError": "errors",
    "register_invariant": "gate.invariants",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'pytest_circuits' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    return getattr(module, "register" if name == "register_invariant" else name)
