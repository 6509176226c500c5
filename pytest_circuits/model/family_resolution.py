"""Which `Family` a model is: the table, then entry points of other packages, then a layout recognised
from the module names and weight shapes (`infer_family`); its `Geometry` from the config."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any

import torch

from ..errors import CircuitsWarning, ModelLoadError, UnknownFamilyError
from . import family_table
from .family_stacks import NO_PER_HEAD_OV
from .family_table import ADD_FAMILY, ENTRY_POINT_GROUP, HYBRID_LAYER_ATTRS, Family, Geometry
from .module_paths import attn_norm_module, modules_at

# ---------------------------------------------------------------- resolution


_PLUGINS: list[Family] | None = None
_INFERRED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WARNED: set[str] = set()


def plugin_families() -> list[Family]:
    """Families other packages declare under the entry point group ``pytest_circuits.families``.

    Each entry point loads to a `Family` or a sequence of them (or a callable returning
    either). Loaded once, lazily; a broken plugin is named in a one-line error.
    """
    global _PLUGINS
    if _PLUGINS is None:
        from importlib.metadata import entry_points

        found: list[Family] = []
        for point in entry_points(group=ENTRY_POINT_GROUP):
            try:
                value = point.load()
                value = value() if callable(value) and not isinstance(value, Family) else value
            except Exception as error:  # a third-party package: name it, do not crash deep inside
                raise UnknownFamilyError(
                    f"family plugin {point.name!r} ({point.value}) failed to load: {error}; "
                    "fix or uninstall that package"
                ) from None
            items = [value] if isinstance(value, Family) else list(value)
            bad = [type(item).__name__ for item in items if not isinstance(item, Family)]
            if bad:
                raise UnknownFamilyError(
                    f"family plugin {point.name!r} gave {', '.join(bad)}, not pytest_circuits Family entries"
                )
            found.extend(items)
        _PLUGINS = found
    return _PLUGINS


def all_families() -> list[Family]:
    """The table, then plugin entries (a plugin entry for a listed type takes precedence)."""
    return [*plugin_families(), *family_table.FAMILIES]


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` the table (and installed plugins) know."""
    return sorted({t for f in all_families() for t in f.model_types})


def _candidates(model_type: str | None) -> list[Family]:
    return [f for f in all_families() if model_type in f.model_types]


def _softmax_kind(kind: str) -> bool:
    """A layer kind with softmax attention: ``attention``, ``full_attention``, ``sliding_attention`` (not
    ``linear_attention``: Mamba, DeltaNet), or ``hybrid`` (attention beside Mamba in one block)."""
    return ("attention" in kind and "linear" not in kind) or kind == "hybrid"


def _hybrid_layers(config) -> str:
    for attr in HYBRID_LAYER_ATTRS:
        kinds = getattr(config, attr, None)
        if isinstance(kinds, (list, tuple)) and kinds:
            attention = [i for i, k in enumerate(kinds) if _softmax_kind(str(k).lower())]
            other = [i for i, k in enumerate(kinds) if i not in attention]
            if attention and other:
                return f"; attention layers {attention}, other layers {other}"
    return ""


def _unsupported_line(model_type) -> str:
    return (
        f"model family {model_type!r} is not supported; supported: {', '.join(supported_model_types())} ({ADD_FAMILY})"
    )


def _resolve_listed(config, model_type: str | None) -> Family | None:
    candidates = _candidates(model_type)
    if not candidates:
        return None
    for family in candidates:
        if family.matches(config):
            for left, right in family.requires_equal:
                a, b = getattr(config, left, None), getattr(config, right, None)
                if a is not None and b is not None and a != b:
                    raise UnknownFamilyError(
                        f"model family {model_type!r} with {left}={a} != {right}={b} is not supported: {family.unsupported}"
                    )
            return family
    conditions = "; ".join(", ".join(f"{a}={v!r}" for a, v in f.when) for f in candidates)
    raise UnknownFamilyError(
        f"model family {model_type!r}: this config variant is not supported (supported variants: {conditions})"
    )


def _listed_or_refused(config, model_type: str | None) -> Family | None:
    """The listed family of ``config`` (table or entry point); a model type with no per-head OV map
    is refused in one line; None when nobody listed it (inference comes next)."""
    family = _resolve_listed(config, model_type)
    if family is None and model_type in NO_PER_HEAD_OV:
        raise UnknownFamilyError(
            f"model family {model_type!r} has no per-head OV map to read: {NO_PER_HEAD_OV[model_type]}{_hybrid_layers(config)}"
        )
    return family


def family_for_config(config) -> Family:
    """The family of a transformers config, or a one-line error naming why not.

    A model type nobody listed is recognised from an empty (meta-device) instance of its
    architecture when its module names and shapes match a known layout (`infer_family`).
    """
    model_type = getattr(config, "model_type", None)
    family = _listed_or_refused(config, model_type)
    if family is not None:
        return family
    model = _meta_model(config)
    family = infer_family(model) if model is not None else None
    if family is None:
        raise UnknownFamilyError(_unsupported_line(model_type))
    return family


def _meta_model(config):
    """An empty instance of the config's CausalLM on the meta device (no memory, no weights), or None."""
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except Exception:
        return None


def family_of(model) -> Family:
    """The family entry of a loaded CausalLM (listed, from a plugin, or recognised by layout)."""
    cached = _INFERRED.get(model)
    if cached is not None:
        return cached
    config = model.config
    model_type = getattr(config, "model_type", None)
    family = _listed_or_refused(config, model_type)
    if family is not None:
        return family
    family = infer_family(model)
    if family is None:
        raise UnknownFamilyError(_unsupported_line(model_type))
    _INFERRED[model] = family
    return family


_QUIRK_FREE: dict[str, Any] = dict(
    norm_weight_offset=0.0,
    norm_eps=None,
    embed_scale=None,
    embed_norm=None,
    post_attn_norm=None,
    attn_adds_residual=None,
    attn_out_multiplier=None,
    logit_scale=None,
    logit_divisor=None,
    logit_softcap=None,
    quirks=(),
    when=(),
    requires_equal=(),
    unsupported="",
)


def _layouts() -> list[Family]:
    """One quirk-free representative per distinct structure, in the order they are tried.

    Layouts without a pre-attention norm are not offered: a model whose norm has another name
    would match them and be read without its norm (the attention check alone cannot see that).
    """
    seen, out = set(), []
    for family in all_families():
        key = (
            family.layers,
            family.attn,
            family.out_proj,
            family.qkv,
            family.qkv_layout,
            family.attn_norm,
            family.final_norm,
        )
        if (
            key not in seen
            and not family.when
            and not family.unsupported
            and family.attn_norm is not None
            and family.latent_norm is None
        ):
            seen.add(key)
            out.append(dataclasses.replace(family, **_QUIRK_FREE))
    return out


def _norm_kind_of(module) -> str | None:
    name = type(module).__name__.lower()
    if "rms" in name:
        return "rmsnorm"
    if isinstance(module, torch.nn.LayerNorm) or "layernorm" in name:
        return "layernorm"
    return None


def infer_family(model) -> Family | None:
    """A known layout whose module paths and weight shapes fit ``model``, marked ``assumed``; else None.

    Checks: the decoder blocks, attention, Q/K/V and output projections, norms exist at the
    layout's paths; the projections' shapes fit the config's geometry under the layout;
    the norms' kind is told by their class (RMSNorm vs LayerNorm). The quirks of an
    assumed layout are none: the self-check on load confirms the per-head read, and a warning
    says in one line which layout was assumed.
    """
    model_type = getattr(model.config, "model_type", None)
    if not isinstance(model_type, str):  # transformers configs always carry one ("" on the base class)
        return None
    for layout in _layouts():
        candidate = layout.for_type(model_type, quirks=(), assumed=True, name=layout.name)
        try:
            blocks = modules_at(model, candidate.layers)
            block = blocks[0]
            attn = block.get_submodule(candidate.attn)
            projs = [attn.get_submodule(p) for p in candidate.qkv]
            out = attn.get_submodule(candidate.out_proj)
            norm = attn_norm_module(block, candidate)
            final = model.get_submodule(candidate.final_norm)
        except (AttributeError, IndexError, TypeError):
            continue
        kind = _norm_kind_of(norm) or _norm_kind_of(final)
        if kind is None:
            continue
        candidate = dataclasses.replace(candidate, norm_kind=kind)
        try:
            geo = geometry_for(model.config, candidate)
        except Exception:  # a config that does not say its geometry the usual way (per-layer head sizes, ...)
            continue
        if not _shapes_fit(candidate, geo, projs, out):
            continue
        if model_type not in _WARNED:
            _WARNED.add(model_type)
            warnings.warn(
                f"model type {model_type!r} is not in the family table: assumed the {layout.name!r} layout "
                f"({candidate.layers}.N.{candidate.attn}), confirmed by the self-check on load (attention output, "
                "residual write, embedding and logits; a module the layout never reads is refused)",
                CircuitsWarning,
                stacklevel=2,
            )
        return candidate
    return None


def _weight_shape(module) -> tuple[int, int] | None:
    from .dense import is_projection

    if not is_projection(module):
        return None
    shape = tuple(module.weight.shape)
    if type(module).__name__ == "Conv1D":
        shape = shape[::-1]
    return shape if len(shape) == 2 else None


def _shapes_fit(family: Family, geo: Geometry, projs, out) -> bool:
    shapes = [s for s in (_weight_shape(p) for p in projs) if s is not None]
    out_shape = _weight_shape(out)
    if len(shapes) != len(projs) or out_shape is None:
        return False
    q_rows, kv_rows = geo.n_heads * geo.d_head, geo.n_kv_heads * geo.d_head
    rows = [s[0] for s in shapes]
    if any(s[1] != geo.d_model for s in shapes):
        return False
    expected = {
        "separate": [q_rows, kv_rows, kv_rows],
        "fused_split": [q_rows + 2 * kv_rows],
        "fused_per_head": [3 * q_rows],
        "fused_grouped": [q_rows + 2 * kv_rows],
    }[family.qkv_layout]
    return rows == expected and out_shape == (geo.d_model, q_rows)


def geometry_for(config, family: Family) -> Geometry:
    """Layers, heads, key/value heads, widths and vocabulary from a config, as ``family`` reads them."""
    n_heads = getattr(config, family.n_heads_attr)
    n_kv: int | None
    if family.multi_query_attr and getattr(config, family.multi_query_attr, False):
        n_kv = 1
    else:
        n_kv = getattr(config, family.n_kv_heads_attr, None) if family.n_kv_heads_attr else None
    d_model = getattr(config, family.d_model_attr)
    d_head = getattr(config, family.d_head_attr, None) or d_model // n_heads
    attention = attention_blocks(config, family)
    return Geometry(
        n_layers=getattr(config, family.n_layers_attr) if attention is None else len(attention),
        attention_layers=attention,
        n_heads=n_heads,
        n_kv_heads=n_kv or n_heads,
        d_model=d_model,
        d_head=d_head,
        vocab=config.vocab_size,
    )


def attention_blocks(config, family: Family) -> tuple[int, ...] | None:
    """The blocks of a hybrid stack that hold softmax attention (``config.layer_types`` entries equal to
    ``family.attention_blocks``); None for a stack of attention blocks only. A stack with none is refused."""
    if family.attention_blocks is None:
        return None
    kinds = list(getattr(config, "layer_types", None) or [])
    found = tuple(i for i, kind in enumerate(kinds) if kind == family.attention_blocks)
    if not found:
        raise UnknownFamilyError(
            f"model family {config.model_type!r}: this config has no {family.attention_blocks} layer (layer_types: "
            f"{sorted(set(map(str, kinds)))}); a stack of linear attention, state-space or convolution layers only "
            "has no softmax heads, so no per-head OV map or routing to gate"
        )
    return found


def family_and_geometry(config) -> tuple[Family, Geometry]:
    """The family entry and the `Geometry` of a transformers config, without loading weights.

    The one resolution path for a config (the session's preflight, external builds, loads, the
    CLI and the plugin): the table, plugins, then a layout recognised from an empty instance.
    """
    family = family_for_config(config)
    return family, geometry_for(config, family)


def bind_family(model, family: Family) -> None:
    """Make ``family_of(model)`` return ``family`` (the entry its config resolved to before loading)."""
    _INFERRED[model] = family


def geometry_of(model) -> Geometry:
    """Layers, heads, key/value heads, widths and vocabulary of a loaded CausalLM."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"geometry_of takes a loaded model; for a config use family_and_geometry (got {type(model)})")
    return geometry_for(model.config, family_of(model))


def check_geometry(model: str, geometry: Geometry) -> None:
    """Refuse, in one line, a config with no layers, heads, width or vocabulary (``num_hidden_layers: 0``)."""
    empty = [f"{name} {value}" for name, value in vars(geometry).items() if isinstance(value, int) and not value > 0]
    if empty:
        raise ModelLoadError(
            f"model {model!r}: its config gives {', '.join(empty)} (num_hidden_layers, num_attention_heads, ...); "
            "every count must be at least 1: fix config.json"
        )
