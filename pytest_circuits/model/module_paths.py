"""Modules of a model by dotted path (``model.layers``, ``self_attn.o_proj``), the family table's
addresses, and a block's norms by its `Family` (which need no resolution of the model)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch

from .family_table import Family


def get_module(root: torch.nn.Module, dotted: str) -> torch.nn.Module:
    """``root.a.b.c`` for the dotted path ``"a.b.c"``."""
    return root.get_submodule(dotted)


def modules_at(root: torch.nn.Module, dotted: str) -> list[torch.nn.Module]:
    """The modules of the container at ``dotted`` (the ModuleList of decoder blocks), in order.

    ``get_submodule`` is typed as returning a plain Module; a container iterates over its
    children (one that cannot raises TypeError, as ``list`` does).
    """
    return list(cast(Iterable[torch.nn.Module], get_module(root, dotted)))


def attn_norm_module(block: torch.nn.Module, family: Family) -> torch.nn.Module | None:
    """The pre-attention norm of a block (the first of the alternatives present), or None."""
    if family.attn_norm is None:
        return None
    names = (family.attn_norm,) if isinstance(family.attn_norm, str) else family.attn_norm
    for name in names:
        try:
            return block.get_submodule(name)
        except AttributeError:
            continue
    raise AttributeError(f"none of {names} in {type(block).__name__}")


def post_attn_norm_module(block: torch.nn.Module, family: Family) -> torch.nn.Module | None:
    """The norm on the attention output (sandwich norm), or None."""
    return None if family.post_attn_norm is None else block.get_submodule(family.post_attn_norm)


def final_norm_module(model, family: Family) -> torch.nn.Module | None:
    """The final norm before the unembedding, or None."""
    return None if family.final_norm is None else get_module(model, family.final_norm)
