"""A model's modules by its family (decoder blocks, attention, output projection, norms) and the tail
maths read from the family and the config (embedding scale, logit factor, the final norm and unembedding)."""

from __future__ import annotations

import math

import torch

from .family_resolution import family_of, geometry_of
from .family_table import Family
from .module_paths import final_norm_module, get_module, modules_at


def layer_modules(model) -> list[torch.nn.Module]:
    """The decoder blocks, in order."""
    return modules_at(model, family_of(model).layers)


def attention_block(model, layer: int) -> torch.nn.Module:
    """The decoder block of attention layer ``layer`` (on a hybrid stack, `Geometry.block`)."""
    return layer_modules(model)[geometry_of(model).block(layer)]


def attention_module(model, layer: int) -> torch.nn.Module:
    """The attention module of attention layer ``layer``."""
    return get_module(attention_block(model, layer), family_of(model).attn)


def out_proj_module(model, layer: int) -> torch.nn.Module:
    """The output projection of layer ``layer``; its input is the concatenated head outputs z."""
    return get_module(attention_module(model, layer), family_of(model).out_proj)


def embed_scale_of(model, family: Family) -> float:
    """The positive scalar the residual stream gets on each embedding row (1 for most families)."""
    if family.embed_scale is None:
        return 1.0
    if family.embed_scale == "sqrt_d_model":  # as the model holds it: RecurrentGemma's `normalizer` is bfloat16
        scale = getattr(model.get_input_embeddings(), "embed_scale", None)
        if scale is None:
            scale = getattr(getattr(model, "model", None), "normalizer", None)
        if scale is not None:
            return float(torch.as_tensor(scale).float())
        return math.sqrt(getattr(model.config, family.d_model_attr))
    return float(getattr(model.config, family.embed_scale))


def logit_factor_of(config, family: Family) -> float:
    """The positive scalar the tail multiplies the unembedded logits by (``scale / divisor``)."""
    factor = 1.0
    if family.logit_scale and getattr(config, family.logit_scale, None) is not None:
        factor *= float(getattr(config, family.logit_scale))
    if family.logit_divisor and getattr(config, family.logit_divisor, None) is not None:
        factor /= float(getattr(config, family.logit_divisor))
    return factor


def tail_logits(model, hidden: torch.Tensor, family: Family | None = None) -> torch.Tensor:
    """Logits from the last block's output: final norm, unembedding, then the family's logit factor and soft cap."""
    family = family or family_of(model)
    norm = final_norm_module(model, family)
    logits = model.get_output_embeddings()(hidden if norm is None else norm(hidden))
    factor = logit_factor_of(model.config, family)
    if factor != 1.0:
        logits = logits * factor
    cap = getattr(model.config, family.logit_softcap, None) if family.logit_softcap else None
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


_CONFIG_QUIRKS = {"logit_softcap": "logit_softcap", "logit_scale": "logit_scale"}
"""Quirk tags that hold only when the family's config attribute of that name is set (not None, not 0)."""


def active_quirks(family: Family, config) -> list[str]:
    """The family's quirk tags that this config enables: a soft cap or logit scale only when set, a sliding
    window only when some layer slides, attention soft-capping only when ``attn_logit_softcapping`` is set."""
    active = []
    for tag in family.quirks:
        field = _CONFIG_QUIRKS.get(tag)
        if field is not None and not getattr(config, getattr(family, field) or "", None):
            continue
        if tag == "sliding_window" and not attention_windows(config):
            continue
        if tag == "attn_softcap" and not getattr(config, "attn_logit_softcapping", None):
            continue
        active.append(tag)
    return active


SLIDING_LAYER_TYPES = ("sliding_attention", "local")  # layer_types / attention_layers entries that slide


def attention_windows(config) -> dict[int, int]:
    """``{layer: w}`` for every layer that attends within a sliding window of ``w`` positions
    (a query sees itself and the ``w - 1`` before it); layers absent attend to the whole prefix.

    Read from the config as transformers builds the masks: ``layer_types`` (``"sliding_attention"``
    layers get ``sliding_window``), GPT-Neo's ``attention_layers`` (``"local"`` layers get
    ``window_size``), else ``sliding_window`` on every layer unless ``use_sliding_window`` is False.
    """
    n_layers = next(
        (v for a in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(v := getattr(config, a, None), int)),
        0,
    )
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if getattr(config, "attention_layers", None) is not None:  # GPT-Neo
        kinds, window = config.attention_layers, getattr(config, "window_size", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return {}
    if kinds is not None:
        return {i: window for i, kind in enumerate(kinds) if kind in SLIDING_LAYER_TYPES}
    if getattr(config, "use_sliding_window", True) is False:
        return {}
    return dict.fromkeys(range(n_layers), window)


def flattens_batch_with_heads(model) -> bool:
    """True when the decoder blocks get a tensor with batch and heads flattened together (ALiBi:
    ``(batch * heads, 1, T)``), so that copies of a batch cannot be stacked on its leading axis."""
    family = family_of(model)
    return "alibi" in family.quirks or bool(getattr(model.config, "alibi", False))
