"""A float32 transformers model written as a GGUF file the way llama.cpp's converter lays it out (gguf's GGUFWriter).

The source of a GGUF quantization (`gguf_quant.py`) and of the tests' tiny GGUF models (`testing.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


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


def _config_value(config, attr: str):
    """``config.<attr>``; transformers 5 keeps ``rope_theta`` only in ``rope_parameters``, and a file
    without ``rope.freq_base`` is read by llama.cpp (and transformers) at theta 10000."""
    value = getattr(config, attr, None)
    if value is None and attr == "rope_theta":
        parameters = getattr(config, "rope_parameters", None)
        value = parameters.get("rope_theta") if isinstance(parameters, dict) else None
    return value


def write_float_gguf(model, path: str | Path, tokens: list[str] | None = None, bos_id: int | None = None) -> Path:
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
        value = _config_value(config, attr) if isinstance(attr, str) else None
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
