"""The one place that maps model families to where their weights live.

Each family is one `Family` table entry. The attention projections come in one of
three layouts (`QKV_LAYOUTS`); a new family that reuses a layout is one entry here.
All per-head slicing works on dense ``(out, in)`` weights (see `dense.py`), so
float, bitsandbytes and Conv1D layers share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnknownFamilyError


@dataclass(frozen=True)
class Family:
    """Where one architecture keeps its modules; dotted paths from the CausalLM root."""

    name: str
    model_types: tuple[str, ...]
    layers: str  # ModuleList of decoder blocks
    attn: str  # attention module inside a block
    out_proj: str  # output projection inside the attention module (its input is z)
    qkv: tuple[str, ...]  # projection module(s) inside the attention module
    qkv_layout: str  # key into QKV_LAYOUTS
    attn_norm: str  # pre-attention norm inside a block
    final_norm: str  # embeddings come from get_input_embeddings / get_output_embeddings
    norm_kind: str  # "layernorm" centres its input, "rmsnorm" does not
    n_heads_attr: str
    n_kv_heads_attr: str | None
    d_model_attr: str
    n_layers_attr: str


@dataclass(frozen=True)
class Geometry:
    """Shape of a model: what a baseline must match before any figure is compared."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    vocab: int

    @property
    def group_size(self) -> int:
        """Query heads per key/value group."""
        return self.n_heads // self.n_kv_heads

    def kv_group(self, head: int) -> int:
        """Key/value group read by query head ``head``: ``h // (n_heads // n_kv_heads)``."""
        return head // self.group_size


FAMILIES: tuple[Family, ...] = (
    Family(
        name="gpt2",
        model_types=("gpt2",),
        layers="transformer.h",
        attn="attn",
        out_proj="c_proj",
        qkv=("c_attn",),
        qkv_layout="fused_thirds",
        attn_norm="ln_1",
        final_norm="transformer.ln_f",
        norm_kind="layernorm",
        n_heads_attr="n_head",
        n_kv_heads_attr=None,
        d_model_attr="n_embd",
        n_layers_attr="n_layer",
    ),
    Family(
        name="gpt_neox",
        model_types=("gpt_neox",),
        layers="gpt_neox.layers",
        attn="attention",
        out_proj="dense",
        qkv=("query_key_value",),
        qkv_layout="fused_per_head",
        attn_norm="input_layernorm",
        final_norm="gpt_neox.final_layer_norm",
        norm_kind="layernorm",
        n_heads_attr="num_attention_heads",
        n_kv_heads_attr=None,
        d_model_attr="hidden_size",
        n_layers_attr="num_hidden_layers",
    ),
    Family(
        name="llama",
        model_types=("llama", "mistral", "qwen2", "smollm3"),
        layers="model.layers",
        attn="self_attn",
        out_proj="o_proj",
        qkv=("q_proj", "k_proj", "v_proj"),
        qkv_layout="separate",
        attn_norm="input_layernorm",
        final_norm="model.norm",
        norm_kind="rmsnorm",
        n_heads_attr="num_attention_heads",
        n_kv_heads_attr="num_key_value_heads",
        d_model_attr="hidden_size",
        n_layers_attr="num_hidden_layers",
    ),
)

_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` the table knows."""
    return sorted(_BY_MODEL_TYPE)


def family_for_config(config) -> Family:
    """The family entry for a transformers config, or a one-line error naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise UnknownFamilyError(
            f"model family {model_type!r} is not supported; supported: "
            f"{', '.join(supported_model_types())} (add one entry to pytest_circuits/families.py)"
        )
    return family


def family_of(model) -> Family:
    """The family entry of a loaded CausalLM."""
    return family_for_config(model.config)


def geometry_of(model) -> Geometry:
    """Layers, heads, key/value heads, widths and vocabulary of a loaded model."""
    cfg = model.config
    fam = family_of(model)
    n_heads = getattr(cfg, fam.n_heads_attr)
    n_kv = getattr(cfg, fam.n_kv_heads_attr, None) if fam.n_kv_heads_attr else None
    d_model = getattr(cfg, fam.d_model_attr)
    d_head = getattr(cfg, "head_dim", None) or d_model // n_heads
    return Geometry(
        n_layers=getattr(cfg, fam.n_layers_attr),
        n_heads=n_heads,
        n_kv_heads=n_kv or n_heads,
        d_model=d_model,
        d_head=d_head,
        vocab=cfg.vocab_size,
    )


def head_label(layer: int, head: int) -> str:
    """``L{layer}H{head}``, zero-based."""
    return f"L{layer}H{head}"


def get_module(root: torch.nn.Module, dotted: str) -> torch.nn.Module:
    """``root.a.b.c`` for the dotted path ``"a.b.c"``."""
    return root.get_submodule(dotted)


def layer_modules(model) -> list[torch.nn.Module]:
    """The decoder blocks, in order."""
    return list(get_module(model, family_of(model).layers))


def attention_module(model, layer: int) -> torch.nn.Module:
    """The attention module of block ``layer``."""
    fam = family_of(model)
    return get_module(layer_modules(model)[layer], fam.attn)


def out_proj_module(model, layer: int) -> torch.nn.Module:
    """The output projection of layer ``layer``; its input is the concatenated head outputs z."""
    return get_module(attention_module(model, layer), family_of(model).out_proj)


def split_qkv(layout: str, weights: list[torch.Tensor], geo: Geometry):
    """Split dense ``(out, in)`` projection weights (or biases, 1-D) into per-head Q, K, V.

    Returns ``(q, k, v)`` with leading head axes: weights ``(heads, d_head, in)``,
    biases ``(heads, d_head)``; ``k`` and ``v`` have ``n_kv_heads`` heads.
    """
    return QKV_LAYOUTS[layout](weights, geo)


def _fused_thirds(weights, geo):
    """GPT-2: rows ``[q | k | v]``, head h at rows ``h*d_head:(h+1)*d_head`` of each third."""
    (w,) = weights
    q, k, v = w.split(geo.n_heads * geo.d_head, dim=0)
    return tuple(t.reshape(geo.n_heads, geo.d_head, *t.shape[1:]) for t in (q, k, v))


def _fused_per_head(weights, geo):
    """GPT-NeoX: rows grouped per head as ``[q_h | k_h | v_h]`` (checked against a forward in tests)."""
    (w,) = weights
    per_head = w.reshape(geo.n_heads, 3, geo.d_head, *w.shape[1:])
    return per_head[:, 0], per_head[:, 1], per_head[:, 2]


def _separate(weights, geo):
    """Llama family: separate q_proj, k_proj, v_proj, each head a block of rows."""
    wq, wk, wv = weights
    return (
        wq.reshape(geo.n_heads, geo.d_head, *wq.shape[1:]),
        wk.reshape(geo.n_kv_heads, geo.d_head, *wk.shape[1:]),
        wv.reshape(geo.n_kv_heads, geo.d_head, *wv.shape[1:]),
    )


QKV_LAYOUTS = {
    "fused_thirds": _fused_thirds,
    "fused_per_head": _fused_per_head,
    "separate": _separate,
}
