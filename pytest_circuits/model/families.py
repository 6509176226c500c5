"""The one place that maps model types to where their weights live, and what they do to them.

Declarative, in the style of pyvene's and TransformerLens's adapters: a `Family` names the
module paths of one layout (decoder blocks, attention, Q/K/V and output projections,
norms), its Q/K/V packing (`QKV_LAYOUTS`) and the quirks that bear on a read as data
(`norm_weight_offset`, `embed_scale`, `post_attn_norm`, ...). One entry per model type
(or per config variant, `when`); a model type that merely reuses a layout is one entry.

Resolution (`family_for_config`, `family_of`): the table, then entry points of other
packages (group ``pytest_circuits.families``, each a `Family` or a sequence of them),
then, for a model type nobody listed, a layout recognised from the module names and
weight shapes (`infer_family`); the self-check (`selfcheck.py`) confirms the read on
every load. Model types with no per-head OV map get a one-line refusal that says why.
All per-head slicing works on dense ``(out, in)`` weights (`dense.py`), so float,
bitsandbytes and Conv1D layers share one code path.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..errors import ModelLoadError, UnknownFamilyError

ENTRY_POINT_GROUP = "pytest_circuits.families"


@dataclass(frozen=True)
class Family:
    """Where one model type keeps its modules (dotted paths) and what it does around attention.

    Structure: ``layers`` (ModuleList of decoder blocks, from the CausalLM root); ``attn``,
    ``attn_norm`` (pre-attention norm; a tuple lists alternatives, the first present wins;
    ``None``: the attention reads the raw residual), ``post_attn_norm`` (a norm on the
    attention output, sandwich style) inside a block; ``qkv`` and ``out_proj`` (its input
    is the concatenated head outputs z) inside the attention module; ``final_norm`` from the
    root. Quirks, as data: ``norm_weight_offset`` (norms scale by ``offset + w``: Gemma's
    ``1 + w``), ``embed_scale`` (``"sqrt_d_model"`` or a config attribute: the residual gets
    ``scale * W_E[token]``), ``embed_norm`` (a norm applied to each embedding row),
    ``attn_adds_residual`` (name of the attention forward's argument that it adds to its
    output: BLOOM), ``attn_out_multiplier`` (config attribute scaling the attention output
    in the block: Granite), ``logit_scale`` / ``logit_divisor`` / ``logit_softcap`` (config
    attributes of the tail: ``logits = cap * tanh(scale * l / div / cap)``), ``quirks``
    (tags of `QUIRKS`, shown in the table), ``when`` (config ``(attribute, value)`` pairs this
    variant needs), ``requires_equal`` (config attribute pairs that must be equal, else the
    variant is refused with ``unsupported``). The block around the attention, for the
    self-check of what it writes into the residual stream: ``resid_mid`` (a block submodule whose
    input is the residual after the attention sublayer: the pre-MLP norm, or the MLP itself),
    ``parallel`` (True, or a config flag that makes it so: attention and MLP both read the
    block's input, and ``resid_out = resid_pre + attention write + output of mlp_out``).
    """

    name: str  # the layout
    model_types: tuple[str, ...]
    layers: str
    attn: str
    out_proj: str
    qkv: tuple[str, ...]
    qkv_layout: str  # key into QKV_LAYOUTS
    attn_norm: str | tuple[str, ...] | None
    final_norm: str | None
    norm_kind: str  # "layernorm" centres its input, "rmsnorm" does not
    n_heads_attr: str = "num_attention_heads"
    n_kv_heads_attr: str | None = "num_key_value_heads"
    d_model_attr: str = "hidden_size"
    n_layers_attr: str = "num_hidden_layers"
    multi_query_attr: str | None = None  # config flag: one K/V head for all query heads
    norm_weight_offset: float = 0.0
    norm_eps: float | None = None  # eps of norms that keep it hard-coded (no attribute): OLMo's 1e-5
    embed_scale: str | None = None
    embed_norm: str | None = None
    post_attn_norm: str | None = None
    attn_adds_residual: str | None = None
    attn_out_multiplier: str | None = None
    logit_scale: str | None = None
    logit_divisor: str | None = None
    logit_softcap: str | None = None
    quirks: tuple[str, ...] = ()
    when: tuple[tuple[str, object], ...] = ()
    requires_equal: tuple[tuple[str, str], ...] = ()
    unsupported: str = ""
    assumed: bool = False  # recognised by `infer_family`, not listed
    resid_mid: str = "post_attention_layernorm"
    parallel: bool | str = False
    mlp_out: str = "mlp"

    def matches(self, config) -> bool:
        """True when every ``when`` condition holds on ``config``."""
        return all(getattr(config, attr, None) == value for attr, value in self.when)

    def is_parallel(self, config) -> bool:
        """True when the block adds attention and MLP outputs of the same input (``parallel``)."""
        return bool(getattr(config, self.parallel, False)) if isinstance(self.parallel, str) else self.parallel

    def for_type(self, model_type: str, **changes) -> Family:
        """This layout for another model type (one table entry)."""
        return dataclasses.replace(self, model_types=(model_type,), **changes)


QUIRKS = {
    "fused_qkv": "one projection holds Q, K and V; split by the layout named in the table",
    "conv1d": "projections stored (in, out) (GPT-2 Conv1D); read transposed",
    "multi_query": "one K/V head shared by every query head; W_OV = W_V[0] W_O[h]",
    "grouped_query": "K/V heads shared by groups of query heads; W_OV = W_V[h // group] W_O[h]",
    "qkv_bias": "biases on Q/K/V (b_V enters the attention output, not W_OV)",
    "learned_positions": "learned absolute position embeddings added to the residual",
    "rotary": "rotary positions on Q and K: change A only, not W_OV",
    "partial_rotary": "rotary on part of each head's Q/K only: changes A only",
    "alibi": "ALiBi position bias added to the scores: changes A only (the self-check uses the A used)",
    "parallel_block": "attention and MLP read the same normed residual; the attention read is unchanged",
    "qk_norm": "a norm on each head's Q and K: changes A only",
    "qk_norm_full": "a norm across all heads of Q and of K (OLMo 2): changes A only",
    "sandwich_norm": "a norm on the attention output: per position one positive factor for all heads, its weight folds into W_O",
    "post_norm_only": "no pre-attention norm: heads read the raw residual, nothing folds on the read side",
    "norm_offset": "the norm scales by (1 + w), w stored (Gemma's RMSNorm, Nemotron's LayerNorm1P): the fold uses g = 1 + w",
    "embed_scale": "embedding multiplied by a positive scalar (sqrt(d_model) or a multiplier): kappa unchanged, W_E carries it",
    "embed_norm": "a LayerNorm on the embedding: W_E is read through it row by row (exact, per token)",
    "sliding_window": "some or all layers attend within a window; a probe longer than it is refused in one line",
    "local_attention": "alternate layers attend within a local window; a probe longer than it is refused",
    "no_score_scaling": "scores not divided by sqrt(d_head): changes A only",
    "attn_softcap": "attention logits soft-capped: changes A only",
    "logit_softcap": "final logits soft-capped (monotone per token); kappa reads the logits before the cap",
    "logit_scale": "logits multiplied or divided by a positive scalar: kappa unchanged, W_U carries it",
    "multipliers": "embedding, attention, residual and logit multipliers (positive scalars): kappa unchanged",
    "attention_sinks": "a learned per-head sink logit joins each softmax: rows of A sum to < 1; W_OV unchanged",
    "moe": "mixture-of-experts MLP: not part of the OV read; routing is replayed per call in knockouts",
    "nope_layers": "some layers use no positional encoding: changes A only",
    "lm_head_bias": "the unembedding has a bias: a constant per token, outside W_U",
    "nonparametric_norm": "LayerNorm without weight or bias: g = 1",
    "no_norm_bias": "LayerNorm without bias (centres, scales by w)",
    "attn_output_residual": "the attention module adds the residual to its own output (BLOOM); the self-check subtracts it",
}


def _split_qkv(**kw) -> Family:
    """Llama-style: separate q_proj, k_proj, v_proj and o_proj under ``model.layers.N.self_attn``."""
    base: dict[str, Any] = dict(
        name="llama",
        model_types=("llama",),
        layers="model.layers",
        attn="self_attn",
        out_proj="o_proj",
        qkv=("q_proj", "k_proj", "v_proj"),
        qkv_layout="separate",
        attn_norm="input_layernorm",
        final_norm="model.norm",
        norm_kind="rmsnorm",
    )
    base.update(kw)
    return Family(**base)


LLAMA = _split_qkv(quirks=("grouped_query", "rotary"))
GPT2 = Family(
    name="gpt2",
    model_types=("gpt2",),
    layers="transformer.h",
    attn="attn",
    out_proj="c_proj",
    qkv=("c_attn",),
    qkv_layout="fused_split",
    attn_norm="ln_1",
    final_norm="transformer.ln_f",
    norm_kind="layernorm",
    n_kv_heads_attr=None,
    resid_mid="ln_2",
    quirks=("fused_qkv", "conv1d", "qkv_bias", "learned_positions"),
)
GPT_NEOX = Family(
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
    n_kv_heads_attr=None,
    parallel="use_parallel_residual",
    quirks=("fused_qkv", "qkv_bias", "partial_rotary", "parallel_block"),
)
_TRANSFORMER_H: dict[str, Any] = dict(
    layers="transformer.h", final_norm="transformer.ln_f", norm_kind="layernorm", n_kv_heads_attr=None
)
_BIGCODE = Family(
    name="gpt_bigcode",
    model_types=("gpt_bigcode",),
    attn="attn",
    out_proj="c_proj",
    qkv=("c_attn",),
    qkv_layout="fused_split",
    attn_norm="ln_1",
    multi_query_attr="multi_query",
    resid_mid="ln_2",
    quirks=("fused_qkv", "multi_query", "qkv_bias", "learned_positions"),
    when=(("multi_query", True),),
    **_TRANSFORMER_H,
)
_FALCON = Family(
    name="falcon",
    model_types=("falcon",),
    attn="self_attention",
    out_proj="dense",
    qkv=("query_key_value",),
    qkv_layout="fused_split",
    attn_norm=("ln_attn", "input_layernorm"),
    multi_query_attr="multi_query",
    parallel="parallel_attn",
    quirks=("fused_qkv", "multi_query", "rotary", "parallel_block"),
    when=(("new_decoder_architecture", False), ("multi_query", True)),
    **_TRANSFORMER_H,
)
_RMS_OFFSET: dict[str, Any] = dict(norm_weight_offset=1.0, embed_scale="sqrt_d_model")
_SEP_LAYERNORM = dict(norm_kind="layernorm")
_POST_NORM_ONLY: dict[str, Any] = dict(attn_norm=None, post_attn_norm="post_attention_layernorm", resid_mid="mlp")

FAMILIES: tuple[Family, ...] = (
    GPT2,
    Family(
        name="gpt_neo",
        model_types=("gpt_neo",),
        attn="attn.attention",
        out_proj="out_proj",
        qkv=("q_proj", "k_proj", "v_proj"),
        qkv_layout="separate",
        attn_norm="ln_1",
        resid_mid="ln_2",
        quirks=("learned_positions", "local_attention", "no_score_scaling"),
        **_TRANSFORMER_H,
    ),
    Family(
        name="gptj",
        model_types=("gptj",),
        attn="attn",
        out_proj="out_proj",
        qkv=("q_proj", "k_proj", "v_proj"),
        qkv_layout="separate",
        attn_norm="ln_1",
        parallel=True,
        quirks=("partial_rotary", "parallel_block", "lm_head_bias"),
        **_TRANSFORMER_H,
    ),
    _BIGCODE,
    dataclasses.replace(
        _BIGCODE,
        qkv_layout="fused_per_head",
        when=(("multi_query", False),),
        quirks=("fused_qkv", "qkv_bias", "learned_positions"),
    ),
    GPT_NEOX,
    Family(
        name="opt",
        model_types=("opt",),
        layers="model.decoder.layers",
        attn="self_attn",
        out_proj="out_proj",
        qkv=("q_proj", "k_proj", "v_proj"),
        qkv_layout="separate",
        attn_norm="self_attn_layer_norm",
        final_norm="model.decoder.final_layer_norm",
        norm_kind="layernorm",
        n_kv_heads_attr=None,
        resid_mid="final_layer_norm",
        quirks=("qkv_bias", "learned_positions"),
        when=(("do_layer_norm_before", True),),
        requires_equal=(("word_embed_proj_dim", "hidden_size"),),
        unsupported="projections between a narrower embedding and the residual (word_embed_proj_dim) are not read yet",
    ),
    Family(
        name="bloom",
        model_types=("bloom",),
        attn="self_attention",
        out_proj="dense",
        qkv=("query_key_value",),
        qkv_layout="fused_per_head",
        attn_norm="input_layernorm",
        embed_norm="transformer.word_embeddings_layernorm",
        attn_adds_residual="residual",
        quirks=("fused_qkv", "qkv_bias", "alibi", "embed_norm", "attn_output_residual"),
        **_TRANSFORMER_H,
    ),
    _FALCON,
    dataclasses.replace(
        _FALCON,
        qkv_layout="fused_per_head",
        multi_query_attr=None,
        when=(("new_decoder_architecture", False), ("multi_query", False)),
        quirks=("fused_qkv", "rotary", "parallel_block"),
    ),
    dataclasses.replace(
        _FALCON,
        qkv_layout="fused_grouped",
        multi_query_attr=None,
        n_kv_heads_attr="num_kv_heads",
        parallel=True,
        when=(("new_decoder_architecture", True),),
        quirks=("fused_qkv", "grouped_query", "rotary", "parallel_block"),
    ),
    LLAMA,
    LLAMA.for_type("mistral", quirks=("grouped_query", "rotary", "sliding_window")),
    LLAMA.for_type("mixtral", quirks=("grouped_query", "rotary", "sliding_window", "moe")),
    LLAMA.for_type("ministral", quirks=("grouped_query", "rotary", "sliding_window")),
    LLAMA.for_type("qwen2", quirks=("grouped_query", "qkv_bias", "rotary", "sliding_window")),
    LLAMA.for_type("qwen2_moe", quirks=("grouped_query", "qkv_bias", "rotary", "sliding_window", "moe")),
    LLAMA.for_type("qwen3", quirks=("grouped_query", "rotary", "qk_norm", "sliding_window")),
    LLAMA.for_type("qwen3_moe", quirks=("grouped_query", "rotary", "qk_norm", "sliding_window", "moe")),
    LLAMA.for_type("gemma", quirks=("grouped_query", "rotary", "norm_offset", "embed_scale"), **_RMS_OFFSET),
    LLAMA.for_type(
        "gemma2",
        post_attn_norm="post_attention_layernorm",
        resid_mid="pre_feedforward_layernorm",
        logit_softcap="final_logit_softcapping",
        quirks=(
            "grouped_query",
            "rotary",
            "norm_offset",
            "embed_scale",
            "sandwich_norm",
            "sliding_window",
            "attn_softcap",
            "logit_softcap",
        ),
        **_RMS_OFFSET,
    ),
    LLAMA.for_type(
        "gemma3_text",
        post_attn_norm="post_attention_layernorm",
        resid_mid="pre_feedforward_layernorm",
        logit_softcap="final_logit_softcapping",
        quirks=(
            "grouped_query",
            "rotary",
            "norm_offset",
            "embed_scale",
            "sandwich_norm",
            "qk_norm",
            "sliding_window",
            "attn_softcap",
            "logit_softcap",
        ),
        **_RMS_OFFSET,
    ),
    LLAMA.for_type(
        "phi",
        out_proj="dense",
        final_norm="model.final_layernorm",
        norm_kind="layernorm",
        parallel=True,
        quirks=("grouped_query", "qkv_bias", "partial_rotary", "parallel_block", "lm_head_bias"),
    ),
    LLAMA.for_type(
        "phi3",
        qkv=("qkv_proj",),
        qkv_layout="fused_split",
        quirks=("fused_qkv", "grouped_query", "rotary", "sliding_window"),
    ),
    LLAMA.for_type(
        "olmo", norm_kind="layernorm", norm_eps=1e-5, quirks=("grouped_query", "rotary", "nonparametric_norm")
    ),
    LLAMA.for_type(
        "olmo2",
        **_POST_NORM_ONLY,
        quirks=("grouped_query", "rotary", "post_norm_only", "sandwich_norm", "qk_norm_full"),
    ),
    LLAMA.for_type(
        "olmo3",
        **_POST_NORM_ONLY,
        quirks=("grouped_query", "rotary", "post_norm_only", "sandwich_norm", "qk_norm_full", "sliding_window"),
    ),
    LLAMA.for_type("olmoe", quirks=("grouped_query", "rotary", "qk_norm_full", "moe")),
    LLAMA.for_type(
        "stablelm",
        norm_kind="layernorm",
        parallel="use_parallel_residual",
        quirks=("grouped_query", "qkv_bias", "partial_rotary"),
    ),
    LLAMA.for_type(
        "cohere",
        norm_kind="layernorm",
        logit_scale="logit_scale",
        parallel=True,
        quirks=("grouped_query", "rotary", "parallel_block", "no_norm_bias", "logit_scale"),
    ),
    LLAMA.for_type(
        "granite",
        embed_scale="embedding_multiplier",
        attn_out_multiplier="residual_multiplier",
        logit_divisor="logits_scaling",
        quirks=("grouped_query", "rotary", "multipliers"),
    ),
    LLAMA.for_type(
        "starcoder2",
        norm_kind="layernorm",
        quirks=("grouped_query", "qkv_bias", "rotary", "sliding_window"),
    ),
    LLAMA.for_type("smollm3", quirks=("grouped_query", "rotary", "nope_layers")),
    LLAMA.for_type("helium", quirks=("grouped_query", "rotary")),
    LLAMA.for_type("glm", quirks=("grouped_query", "qkv_bias", "partial_rotary")),
    LLAMA.for_type("internlm3", quirks=("grouped_query", "rotary")),
    LLAMA.for_type(
        "glm4",
        post_attn_norm="post_self_attn_layernorm",
        quirks=("grouped_query", "qkv_bias", "partial_rotary", "sandwich_norm"),
    ),
    LLAMA.for_type(
        "kolibri1",
        post_attn_norm="post_self_attn_layernorm",
        quirks=("grouped_query", "rotary", "sandwich_norm"),
    ),
    *(
        LLAMA.for_type(
            model_type,
            norm_kind="layernorm",
            logit_scale="logit_scale",
            parallel=True,
            quirks=("grouped_query", "rotary", "parallel_block", "no_norm_bias", "logit_scale", "sliding_window"),
        )
        for model_type in ("cohere2", "cohere2_moe")
    ),
    *(
        LLAMA.for_type(
            "hyperclovax",
            embed_scale="embedding_multiplier",
            attn_out_multiplier="residual_multiplier",
            logit_scale="logits_scaling",
            when=(("use_post_norm", post),),
            quirks=("grouped_query", "rotary", "multipliers", *(("sandwich_norm",) if post else ())),
            **({"post_attn_norm": "post_norm1"} if post else {}),
        )
        for post in (True, False)
    ),
    LLAMA.for_type(
        "nanochat",
        embed_norm="model.norm",
        logit_softcap="final_logit_softcapping",
        quirks=("rotary", "qk_norm", "nonparametric_norm", "embed_norm", "logit_softcap"),
    ),
    LLAMA.for_type(
        "nemotron",
        norm_kind="layernorm",
        norm_weight_offset=1.0,
        quirks=("grouped_query", "partial_rotary", "norm_offset"),
    ),
    LLAMA.for_type(
        "exaone4",
        **_POST_NORM_ONLY,
        quirks=("grouped_query", "rotary", "post_norm_only", "sandwich_norm", "qk_norm", "sliding_window"),
    ),
    LLAMA.for_type(
        "gpt_oss",
        quirks=("grouped_query", "qkv_bias", "rotary", "sliding_window", "attention_sinks", "moe"),
    ),
)

NO_PER_HEAD_OV = {
    "deepseek_v2": "multi-head latent attention: values come from a shared low-rank latent, no per-head W_V",
    "deepseek_v3": "multi-head latent attention: values come from a shared low-rank latent, no per-head W_V",
    "deepseek_v32": "multi-head latent attention with sparse selection: no per-head W_V",
    "minicpm3": "multi-head latent attention: no per-head W_V",
    "longcat_flash": "multi-head latent attention: no per-head W_V",
    "glm4_moe_lite": "multi-head latent attention: no per-head W_V",
    "mamba": "state-space layers: no attention pattern, no per-head OV map",
    "mamba2": "state-space layers: no attention pattern, no per-head OV map",
    "falcon_mamba": "state-space layers: no attention pattern, no per-head OV map",
    "rwkv": "linear attention (RWKV time mixing): no softmax pattern, no per-head OV map",
    "xlstm": "recurrent xLSTM cells: no attention pattern",
    "kimi_linear": "hybrid of linear attention and latent attention: no per-head OV map",
    "recurrent_gemma": "hybrid of RG-LRU recurrences and local attention (hybrid stacks are not covered yet)",
    "jamba": "hybrid of Mamba and attention layers (hybrid stacks are not covered yet)",
    "zamba": "hybrid of Mamba and shared attention layers (hybrid stacks are not covered yet)",
    "zamba2": "hybrid of Mamba and shared attention layers (hybrid stacks are not covered yet)",
    "bamba": "hybrid of Mamba and attention layers (hybrid stacks are not covered yet)",
    "falcon_h1": "each layer runs Mamba beside attention (hybrid stacks are not covered yet)",
    "granitemoehybrid": "hybrid of Mamba and attention layers (hybrid stacks are not covered yet)",
    "nemotron_h": "hybrid of Mamba and attention layers (hybrid stacks are not covered yet)",
    "lfm2": "hybrid of short convolutions and attention layers (hybrid stacks are not covered yet)",
    "lfm2_moe": "hybrid of short convolutions and attention layers (hybrid stacks are not covered yet)",
    "qwen3_next": "hybrid of gated linear attention and gated attention layers (hybrid stacks are not covered yet)",
    "minimax": "hybrid of lightning (linear) attention and softmax attention layers (hybrid stacks are not covered yet)",
}
HYBRID_LAYER_ATTRS = ("layer_types", "layers_block_type", "block_types")


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
    return [*plugin_families(), *FAMILIES]


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` the table (and installed plugins) know."""
    return sorted({t for f in all_families() for t in f.model_types})


def _candidates(model_type: str | None) -> list[Family]:
    return [f for f in all_families() if model_type in f.model_types]


def _hybrid_layers(config) -> str:
    for attr in HYBRID_LAYER_ATTRS:
        kinds = getattr(config, attr, None)
        if isinstance(kinds, (list, tuple)) and kinds:
            attention = [i for i, k in enumerate(kinds) if "attention" in str(k).lower()]
            other = [i for i, k in enumerate(kinds) if i not in attention]
            if attention and other:
                return f"; attention layers {attention}, other layers {other}"
    return ""


def _unsupported_line(model_type) -> str:
    return (
        f"model family {model_type!r} is not supported; supported: {', '.join(supported_model_types())} "
        "(add one entry to pytest_circuits/model/families.py or a pytest_circuits.families entry point)"
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


def family_for_config(config) -> Family:
    """The family of a transformers config, or a one-line error naming why not.

    A model type nobody listed is recognised from an empty (meta-device) instance of its
    architecture when its module names and shapes match a known layout (`infer_family`).
    """
    model_type = getattr(config, "model_type", None)
    family = _resolve_listed(config, model_type)
    if family is not None:
        return family
    if model_type in NO_PER_HEAD_OV:
        raise UnknownFamilyError(
            f"model family {model_type!r} has no per-head OV map to read: {NO_PER_HEAD_OV[model_type]}{_hybrid_layers(config)}"
        )
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
    family = _resolve_listed(config, model_type)
    if family is not None:
        return family
    if model_type in NO_PER_HEAD_OV:
        raise UnknownFamilyError(
            f"model family {model_type!r} has no per-head OV map to read: {NO_PER_HEAD_OV[model_type]}{_hybrid_layers(config)}"
        )
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
        if key not in seen and not family.when and not family.unsupported and family.attn_norm is not None:
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
    d_head = getattr(config, "head_dim", None) or d_model // n_heads
    return Geometry(
        n_layers=getattr(config, family.n_layers_attr),
        n_heads=n_heads,
        n_kv_heads=n_kv or n_heads,
        d_model=d_model,
        d_head=d_head,
        vocab=config.vocab_size,
    )


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
    empty = [f"{name} {value}" for name, value in vars(geometry).items() if not value > 0]
    if empty:
        raise ModelLoadError(
            f"model {model!r}: its config gives {', '.join(empty)} (num_hidden_layers, num_attention_heads, ...); "
            "every count must be at least 1: fix config.json"
        )


def head_label(layer: int, head: int) -> str:
    """``L{layer}H{head}``, zero-based."""
    return f"L{layer}H{head}"


def get_module(root: torch.nn.Module, dotted: str) -> torch.nn.Module:
    """``root.a.b.c`` for the dotted path ``"a.b.c"``."""
    return root.get_submodule(dotted)


def modules_at(root: torch.nn.Module, dotted: str) -> list[torch.nn.Module]:
    """The modules of the container at ``dotted`` (the ModuleList of decoder blocks), in order.

    ``get_submodule`` is typed as returning a plain Module; a container iterates over its
    children (one that cannot raises TypeError, as ``list`` does).
    """
    return list(cast(Iterable[torch.nn.Module], get_module(root, dotted)))


def layer_modules(model) -> list[torch.nn.Module]:
    """The decoder blocks, in order."""
    return modules_at(model, family_of(model).layers)


def attention_module(model, layer: int) -> torch.nn.Module:
    """The attention module of block ``layer``."""
    fam = family_of(model)
    return get_module(layer_modules(model)[layer], fam.attn)


def out_proj_module(model, layer: int) -> torch.nn.Module:
    """The output projection of layer ``layer``; its input is the concatenated head outputs z."""
    return get_module(attention_module(model, layer), family_of(model).out_proj)


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


def embed_scale_of(model, family: Family) -> float:
    """The positive scalar the residual stream gets on each embedding row (1 for most families)."""
    if family.embed_scale is None:
        return 1.0
    if family.embed_scale == "sqrt_d_model":
        scale = getattr(model.get_input_embeddings(), "embed_scale", None)
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


# ---------------------------------------------------------------- per-head slicing of Q/K/V


def split_qkv(layout: str, weights: list[torch.Tensor], geo: Geometry):
    """Split dense ``(out, in)`` projection weights (or biases, 1-D) into per-head Q, K, V.

    Returns ``(q, k, v)`` with leading head axes: weights ``(heads, d_head, in)``,
    biases ``(heads, d_head)``; ``k`` and ``v`` have ``n_kv_heads`` heads.
    """
    return QKV_LAYOUTS[layout](weights, geo)


def _fused_split(weights, geo):
    """Rows ``[q | k | v]``: ``n_heads*d_head`` query rows, then ``n_kv_heads*d_head`` each of K and V
    (GPT-2 thirds, Phi-3 qkv_proj, GPT-BigCode and Falcon multi-query); head h is a block of rows."""
    (w,) = weights
    kv_rows = geo.n_kv_heads * geo.d_head
    q, k, v = w.split([geo.n_heads * geo.d_head, kv_rows, kv_rows], dim=0)
    return (
        q.reshape(geo.n_heads, geo.d_head, *q.shape[1:]),
        k.reshape(geo.n_kv_heads, geo.d_head, *k.shape[1:]),
        v.reshape(geo.n_kv_heads, geo.d_head, *v.shape[1:]),
    )


def _fused_per_head(weights, geo):
    """GPT-NeoX, BLOOM, Falcon and GPT-BigCode multi-head: rows grouped per head as ``[q_h | k_h | v_h]``."""
    (w,) = weights
    per_head = w.reshape(geo.n_heads, 3, geo.d_head, *w.shape[1:])
    return per_head[:, 0], per_head[:, 1], per_head[:, 2]


def _fused_grouped(weights, geo):
    """Falcon's new decoder: per K/V group g, rows ``[q_{g,0} .. q_{g,G-1} | k_g | v_g]`` (G = group size)."""
    (w,) = weights
    grouped = w.reshape(geo.n_kv_heads, geo.group_size + 2, geo.d_head, *w.shape[1:])
    q = grouped[:, : geo.group_size].reshape(geo.n_heads, geo.d_head, *w.shape[1:])
    return q, grouped[:, -2], grouped[:, -1]


def _separate(weights, geo):
    """Separate q_proj, k_proj, v_proj, each head a block of rows."""
    wq, wk, wv = weights
    return (
        wq.reshape(geo.n_heads, geo.d_head, *wq.shape[1:]),
        wk.reshape(geo.n_kv_heads, geo.d_head, *wk.shape[1:]),
        wv.reshape(geo.n_kv_heads, geo.d_head, *wv.shape[1:]),
    )


QKV_LAYOUTS = {
    "fused_split": _fused_split,
    "fused_per_head": _fused_per_head,
    "fused_grouped": _fused_grouped,
    "separate": _separate,
}


def qkv_rows(layout: str, geo: Geometry) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Row indices (per projection module, concatenated) of each head's Q, each group's K and V.

    Derived by splitting an index vector with the layout itself, so it cannot disagree with `split_qkv`.
    """
    if layout == "separate":
        sizes = [geo.n_heads * geo.d_head, geo.n_kv_heads * geo.d_head, geo.n_kv_heads * geo.d_head]
        parts = [torch.arange(s) for s in sizes]
    else:
        total = geo.n_heads * geo.d_head + 2 * geo.n_kv_heads * geo.d_head
        parts = [torch.arange(total)]
    q, k, v = split_qkv(layout, parts, geo)
    return q.tolist(), k.tolist(), v.tolist()


# ---------------------------------------------------------------- the documented table


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
