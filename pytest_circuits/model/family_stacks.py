"""Family table entries of hybrid stacks and of multi-head latent attention, as data: each a model type and
what differs from Llama's layout (`STACK_ENTRIES`; `family_table.FAMILIES` lists them after the
attention-only layouts), and the one-line reasons of the types that have no per-head OV map (`NO_PER_HEAD_OV`)."""

from __future__ import annotations

from typing import Any

_LATENT: dict[str, Any] = dict(  # multi-head latent attention: V through the shared latent (latent.py)
    name="latent",
    qkv=("kv_a_proj_with_mqa", "kv_b_proj"),
    qkv_layout="latent",
    latent_norm="kv_a_layernorm",
    n_kv_heads_attr=None,
    d_head_attr="v_head_dim",
    when=(("attention_bias", False),),
)


def _entry(model_type: str, **changes: Any) -> tuple[str, dict[str, Any]]:
    """``(model_type, changes)``: one entry of `STACK_ENTRIES`."""
    return model_type, changes


STACK_ENTRIES: tuple[tuple[str, dict[str, Any]], ...] = (
    *(
        _entry(
            model_type,
            final_norm="model.final_layernorm",
            resid_mid="pre_ff_layernorm",
            attention_blocks="full_attention",
            quirks=("hybrid", "grouped_query", *quirks),
        )
        for model_type, quirks in (("bamba", ("partial_rotary",)), ("jamba", ("moe",)))
    ),
    _entry(
        "granitemoehybrid",
        embed_scale="embedding_multiplier",
        attn_out_multiplier="residual_multiplier",
        logit_divisor="logits_scaling",
        attention_blocks="full_attention",
        quirks=("hybrid", "grouped_query", "rotary", "multipliers", "moe"),
    ),
    _entry(
        "falcon_h1",
        final_norm="model.final_layernorm",
        resid_mid="pre_ff_layernorm",
        embed_scale="embedding_multiplier",
        attn_in_multiplier="attention_in_multiplier",
        attn_out_multiplier="attention_out_multiplier",
        logit_scale="lm_head_multiplier",
        beside="mamba",
        beside_multiplier="ssm_out_multiplier",
        quirks=("mamba_beside", "grouped_query", "rotary", "multipliers"),
    ),
    _entry(
        "qwen3_next",
        qkv_layout="separate_gated",
        attention_blocks="full_attention",
        quirks=("hybrid", "grouped_query", "partial_rotary", "qk_norm", "output_gate", "norm_offset", "moe"),
        norm_weight_offset=1.0,
    ),
    *(
        _entry(
            model_type,
            out_proj="out_proj",
            attn_norm="operator_norm",
            resid_mid="ffn_norm",
            final_norm="model.embedding_norm",
            attention_blocks="full_attention",
            quirks=("hybrid", "grouped_query", "rotary", "qk_norm", *moe),
        )
        for model_type, moe in (("lfm2", ()), ("lfm2_moe", ("moe",)))
    ),
    _entry(
        "nemotron_h",
        attn="mixer",
        attn_norm="norm",
        resid_mid=None,
        final_norm="model.norm_f",
        attention_blocks="full_attention",
        quirks=("hybrid", "grouped_query", "nope_layers", "moe"),
    ),
    _entry(
        "recurrent_gemma",
        attn="temporal_block",
        attn_norm="temporal_pre_norm",
        resid_mid="channel_pre_norm",
        mlp_out="mlp_block",
        final_norm="model.final_norm",
        norm_weight_offset=1.0,
        embed_scale="sqrt_d_model",
        logit_softcap="logits_soft_cap",
        attention_blocks="sliding_attention",
        quirks=(
            "hybrid",
            "grouped_query",
            "partial_rotary",
            "norm_offset",
            "embed_scale",
            "sliding_window",
            "logit_softcap",
        ),
    ),
    *(
        _entry(model_type, **_LATENT, quirks=("latent_attention", "rotary", *extra, "moe"))
        for model_type, extra in (
            ("deepseek_v2", ()),
            ("deepseek_v3", ()),
            ("glm4_moe_lite", ()),
            ("deepseek_v32", ("sparse_indexer",)),
        )
    ),
    _entry(
        "minicpm3",
        **_LATENT,
        embed_scale="scale_emb",
        depth_scale="scale_depth",
        logit_divisor="logits_scaling",
        quirks=("latent_attention", "rotary", "multipliers"),
    ),
    _entry(
        "kimi_linear",
        **_LATENT,
        attention_blocks="full_attention",
        quirks=("hybrid", "latent_attention", "nope_layers", "moe"),
    ),
)
"""Model type and its changes to Llama's layout (`Family.for_type`), one per hybrid or latent-attention entry."""


_STATE_SPACE = "state-space layers: no attention pattern, no per-head OV map"
_SHARED_BLOCK = (
    "shared attention blocks whose output reaches only the next Mamba mixer's input, through the block's own "
    "MLP and a per-depth linear map (the residual skips it: Zamba's eq. 6), never the residual stream: no head "
    "writes W_V W_O into the residual, so kappa, ov_gain and the residual-write self-check have no map to read"
)
NO_PER_HEAD_OV = {
    "longcat_flash": (
        "two latent attention sublayers per decoder block (self_attn[0] and self_attn[1], each with its own norms "
        "and MLP, plus a shortcut MoE across both): the read takes one attention module per block, so these "
        "heads are not read"
    ),
    "mamba": _STATE_SPACE,
    "mamba2": _STATE_SPACE,
    "falcon_mamba": _STATE_SPACE,
    "rwkv": "linear attention (RWKV time mixing): no softmax pattern, no per-head OV map",
    "xlstm": "recurrent xLSTM cells: no attention pattern",
    "zamba": _SHARED_BLOCK,
    "zamba2": _SHARED_BLOCK,
    "minimax": (
        "hybrid of lightning (linear) and softmax attention whose blocks renormalise the residual stream itself "
        "(h <- norm(alpha norm(h) + beta attn(norm(h))), then the same around the MLP): a head's write reaches the "
        "logits only through every later norm's per-channel weight, so there is no additive residual stream for "
        "W_E W_OV W_U to read"
    ),
}
"""Model types refused in one line, with why (`family_resolution` adds a hybrid's attention layers)."""
