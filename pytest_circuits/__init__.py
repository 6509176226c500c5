"""pytest-circuits: gate model builds on mechanistic invariants of their attention heads."""

from .errors import BaselineError, CircuitsError, ModelLoadError, RecipeError, UnknownFamilyError
from .model.builds import RECIPES, BuildIdentity, LoadedBuild, load_build, parse_builds
from .model.families import FAMILIES, Geometry
from .model.loading import ModelSource, resolve_model
from .model.weights import ModelWeights, extract_weights

__version__ = "0.1.0"

__all__ = [
    "RECIPES",
    "FAMILIES",
    "BaselineError",
    "BuildIdentity",
    "CircuitsError",
    "Geometry",
    "LoadedBuild",
    "ModelLoadError",
    "ModelSource",
    "ModelWeights",
    "RecipeError",
    "UnknownFamilyError",
    "extract_weights",
    "load_build",
    "parse_builds",
    "resolve_model",
]
