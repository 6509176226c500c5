"""The declarative family table: the one place that maps model types to where their weights live, and what they do to them.

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
from dataclasses import dataclass
from typing import Any

from .family_stacks import STACK_ENTRIES

ENTRY_POINT_GROUP = "pytest_circuits.families"
# How to add a model type, as the errors say it: an entry point first (works with an installed wheel),
# the table itself only in a clone of pytest-circuits
ADD_FAMILY = (
    f'declare a Family under [project.entry-points."{ENTRY_POINT_GROUP}"] in your package\'s pyproject.toml '
    "(docs/families.md); in a clone of pytest-circuits, add one entry to pytest_circuits/model/family_table.py"
)


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
    attributes of the tail: ``logits = cap * tanh(scale * l / div / cap)``), ``depth_scale`` (config
    attribute ``s``: each sublayer's write is multiplied by ``s / sqrt(n_blocks)``: MiniCPM), ``quirks``
    (tags of `quirks.QUIRKS`, shown in the table), ``when`` (config ``(attribute, value)`` pairs this
    variant needs), ``requires_equal`` (config attribute pairs that must be equal, else the
    variant is refused with ``unsupported``). The block around the attention, for the
    self-check of what it writes into the residual stream: ``resid_mid`` (a block submodule whose
    input is the residual after the attention sublayer: the pre-MLP norm, or the MLP itself; None:
    the block's own output, where a block holds the attention alone: Nemotron-H), ``beside`` (a block
    submodule beside the attention whose output, times the config's ``beside_multiplier``, joins the
    attention's write before ``resid_mid``: Falcon-H1's Mamba), ``attn_in_multiplier`` (config attribute:
    the attention reads the normed input times it, folded into ``W_Q, W_K, W_V``),
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
    d_head_attr: str = "head_dim"  # config attribute of the width of a head's value (and of W_O's rows)
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
    resid_mid: str | None = "post_attention_layernorm"  # None: the block's output (a block of attention alone)
    parallel: bool | str = False
    mlp_out: str = "mlp"
    latent_norm: str | None = None  # multi-head latent attention: the norm on the latent c (inside attn)
    attention_blocks: str | None = None  # hybrid stack: the config.layer_types entry of blocks with attention
    attn_in_multiplier: str | None = None  # config attribute scaling the normed input the attention reads
    beside: str | None = None  # block submodule whose output joins the attention's write (Falcon-H1's Mamba)
    beside_multiplier: str | None = None  # config attribute scaling that output
    depth_scale: str | None = None  # config attribute s: the attention's write times s / sqrt(n_blocks) (MiniCPM)

    def matches(self, config) -> bool:
        """True when every ``when`` condition holds on ``config``."""
        return all(getattr(config, attr, None) == value for attr, value in self.when)

    def is_parallel(self, config) -> bool:
        """True when the block adds attention and MLP outputs of the same input (``parallel``)."""
        return bool(getattr(config, self.parallel, False)) if isinstance(self.parallel, str) else self.parallel

    def out_multiplier(self, config) -> float:
        """The positive factor on the attention's write into the residual: ``attn_out_multiplier``'s value
        times ``depth_scale``'s ``s / sqrt(n_blocks)`` (1 where the family has neither)."""
        factor = float(getattr(config, self.attn_out_multiplier, 1.0)) if self.attn_out_multiplier else 1.0
        if self.depth_scale:
            factor *= float(getattr(config, self.depth_scale)) / math.sqrt(getattr(config, self.n_layers_attr))
        return factor

    def for_type(self, model_type: str, **changes) -> Family:
        """This layout for another model type (one table entry)."""
        return dataclasses.replace(self, model_types=(model_type,), **changes)


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
    *(LLAMA.for_type(model_type, **changes) for model_type, changes in STACK_ENTRIES),
)

HYBRID_LAYER_ATTRS = ("layer_types", "layers_block_type", "block_types")


@dataclass(frozen=True)
class Geometry:
    """Shape of a model: what a baseline must match before any figure is compared.

    ``n_layers`` counts attention layers: every block, or on a hybrid stack the blocks with softmax
    attention, ``attention_layers`` (block indices; L2 is the third attention layer). The other
    blocks (Mamba, gated DeltaNet, short convolutions) are the rest of the stack, as MLPs are.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    vocab: int
    attention_layers: tuple[int, ...] | None = None  # hybrid stack: the block of each attention layer L0, L1, ...

    def block(self, layer: int) -> int:
        """The decoder block of attention layer ``layer`` (itself, unless the stack is a hybrid)."""
        return layer if self.attention_layers is None else self.attention_layers[layer]

    @property
    def group_size(self) -> int:
        """Query heads per key/value group."""
        return self.n_heads // self.n_kv_heads

    def kv_group(self, head: int) -> int:
        """Key/value group read by query head ``head``: ``h // (n_heads // n_kv_heads)``."""
        return head // self.group_size


def head_label(layer: int, head: int) -> str:
    """``L{layer}H{head}``, zero-based."""
    return f"L{layer}H{head}"
