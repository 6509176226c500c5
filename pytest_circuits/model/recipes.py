"""Build recipes: the precisions a user gates, each a name typed on the command line.

``fp32``/``bf16``/``fp16`` cast the weights; ``bnb-*`` quantize through transformers'
``BitsAndBytesConfig``; ``rtn-int8``/``rtn-int4`` simulate symmetric per-output-channel
round-to-nearest of every attention and MLP weight (`builds.rtn_quantize_`).

Light: the table names dtypes as strings, so option parsing needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RecipeError


@dataclass(frozen=True)
class Recipe:
    """How to turn the float32 checkpoint into one build."""

    name: str
    backend: str  # "torch", "bitsandbytes" or "rtn"
    dtype: str  # torch dtype name of the float parameters / compute
    summary: str  # shown in the option's help and in errors
    bits: int | None = None
    quant_type: str | None = None  # bitsandbytes 4-bit: "nf4" or "fp4"


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("fp32", "torch", "float32", "float32 reference"),
        Recipe("bf16", "torch", "bfloat16", "bfloat16 weights and compute"),
        Recipe("fp16", "torch", "float16", "float16 weights and compute"),
        Recipe("bnb-int8", "bitsandbytes", "float32", "bitsandbytes LLM.int8()", 8),
        Recipe("bnb-nf4", "bitsandbytes", "float32", "bitsandbytes 4-bit NF4", 4, "nf4"),
        Recipe("bnb-fp4", "bitsandbytes", "float32", "bitsandbytes 4-bit FP4", 4, "fp4"),
        Recipe("rtn-int8", "rtn", "float32", "simulated per-channel round-to-nearest int8", 8),
        Recipe("rtn-int4", "rtn", "float32", "simulated per-channel round-to-nearest int4", 4),
    )
}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``, or a one-line error listing the known ones."""
    recipe = RECIPES.get(name.strip())
    if recipe is None:
        known = "; ".join(f"{r.name} ({r.summary})" for r in RECIPES.values())
        raise RecipeError(f"unknown build recipe {name!r}; known recipes: {known}")
    return recipe


def parse_builds(text: str | list[str]) -> list[str]:
    """``"fp32, bnb-int8"`` -> ``["fp32", "bnb-int8"]``, each checked, duplicates dropped."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names: list[str] = []
    for item in items:
        item = item.strip()
        if item and get_recipe(item).name not in names:
            names.append(item)
    if not names:
        raise RecipeError("no build recipe given; pass e.g. --circuits-builds fp32,bnb-int8")
    return names
