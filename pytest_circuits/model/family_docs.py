"""The documented table of model types (docs/families.md embeds `families_markdown` verbatim), rendered
from the family table, its quirk tags and its refusals."""

from __future__ import annotations

from .family_stacks import NO_PER_HEAD_OV
from .family_table import FAMILIES, Family
from .quirks import QUIRKS


def _tag_cell(family: Family, tag: str) -> str:
    """A quirk tag, marked ``(if set)`` where only a config value enables it (`active_quirks`)."""
    return f"{tag} (if set)" if tag in ("sliding_window", "attn_softcap", "logit_softcap") else tag


def _cell(family: Family) -> str:
    norm = family.norm_kind if family.attn_norm is not None else f"{family.norm_kind} (none before attention)"
    when = ", ".join(f"{a}={v}" for a, v in family.when)
    return (
        f"| `{', '.join(family.model_types)}`{f' ({when})' if when else ''} | {family.name} | "
        f"`{family.layers}.N.{family.attn}` | {family.qkv_layout} (`{'`, `'.join(family.qkv)}`) | {norm} | "
        f"{', '.join(_tag_cell(family, tag) for tag in family.quirks) or '-'} |"
    )


def families_markdown() -> str:
    """The table of supported model types and their quirks (docs/families.md embeds it verbatim)."""
    lines = [
        "| model type | layout | attention module | Q/K/V layout | norm | quirks |",
        "|---|---|---|---|---|---|",
        *(_cell(f) for f in FAMILIES),
        "",
        "| quirk | what it does, and how it bears on the figures |",
        "|---|---|",
        *(f"| {tag} | {meaning} |" for tag, meaning in QUIRKS.items()),
        "",
        "| model type | why it has no per-head OV map |",
        "|---|---|",
        *(f"| `{t}` | {why} |" for t, why in NO_PER_HEAD_OV.items()),
    ]
    return "\n".join(lines) + "\n"
