"""Multi-head latent attention (DeepSeek-V2/V3/V3.2, GLM-4.7-Flash's glm4_moe_lite, MiniCPM3, and Kimi
Linear's latent attention blocks between its KDA blocks), checked against the architecture's equations written
out here from the modules' own parameters, not through the read.

Per head h (DeepSeek-V2 paper, section 2.1): ``c = RMSNorm_c(x W_DKV)`` (the first ``kv_lora_rank``
rows of ``kv_a_proj_with_mqa``), ``[k_h^C | v_h] = c W_B^h`` (``kv_b_proj``, ``qk_nope_head_dim``
then ``v_head_dim`` rows per head), output ``sum_h A_h v_h W_O^h`` (``o_proj``'s columns
``h v_head_dim ..``). So ``W_OV^h = diag(g_in) W_DKV diag(g_c) W_UV^h W_O^h`` up to the two
norms' positive per-position divisors, times MiniCPM3's ``scale_depth / sqrt(n_blocks)`` on the write
(its blocks' ``residual_scale``). Kimi Linear's latent blocks are those whose ``layer_types`` entry is
``full_attention``; the others (KDA linear attention) have no heads.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pytest_circuits.errors import CircuitsError, UnknownFamilyError
from pytest_circuits.model.families import family_for_config, family_of
from pytest_circuits.model.selfcheck import DecompositionError, check_decomposition
from pytest_circuits.model.weights import extract_weights
from pytest_circuits.rungs.kappa import kappa_scores, reduced_ov_layer
from pytest_circuits.rungs.knockout import knockout_scan
from pytest_circuits.rungs.repeat import bos_offset, repeat_tokens
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.testing import make_tiny_model, tiny_config

from .conftest import attention_io
from .test_knockout import own_copy_loss

LATENT_TYPES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "deepseek_v32", "minicpm3", "kimi_linear")
SETTINGS = RepeatSettings(seed=1, n=3, L=8)


def latent_blocks(config) -> list[int]:
    """The blocks holding latent attention: all, or (Kimi Linear) those whose ``layer_types`` entry is not linear."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [i for i, kind in enumerate(kinds) if kind != "linear_attention"]


def _rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """``x / sqrt(mean x^2 + eps) * w`` in float64 (DeepSeek's RMSNorm)."""
    return x / (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt() * norm.weight.double()


@torch.no_grad()
def mla_values(attn, config, x: torch.Tensor) -> torch.Tensor:
    """``v_h`` of every head, ``(heads, T, v_head_dim)``, from the equations on the attention's input ``x`` ``(T, d)``."""
    r = config.kv_lora_rank
    c = _rms(x.double() @ attn.kv_a_proj_with_mqa.weight[:r].double().T, attn.kv_a_layernorm)
    kv = (c @ attn.kv_b_proj.weight.double().T).reshape(x.shape[0], config.num_attention_heads, -1)
    return kv[..., config.qk_nope_head_dim :].transpose(0, 1)


@torch.no_grad()
def mla_w_ov(model, layer: int, head: int) -> torch.Tensor:
    """``diag(g_in) W_DKV diag(g_c) W_UV^h W_O^h m`` (``d_model x d_model``), float64, from the modules' weights
    (``m``: MiniCPM3's ``residual_scale`` on the block's write, else 1)."""
    config = model.config
    block = model.model.layers[latent_blocks(config)[layer]]
    attn, r, v = block.self_attn, config.kv_lora_rank, config.v_head_dim
    W_DKV = attn.kv_a_proj_with_mqa.weight[:r].double().T * block.input_layernorm.weight.double()[:, None]
    per_head = attn.kv_b_proj.weight.double().reshape(config.num_attention_heads, -1, r)[head]
    W_UV = per_head[config.qk_nope_head_dim :].T  # (r, v)
    W_O = attn.o_proj.weight.double()[:, head * v : (head + 1) * v].T  # (v, d_model)
    return (W_DKV * attn.kv_a_layernorm.weight.double()) @ W_UV @ W_O * getattr(block, "residual_scale", 1.0)


@torch.no_grad()
def reference_kappa(model, layer: int, head: int) -> float:
    """kappa by its definition: the mean of ``Re(lambda) / |lambda|`` over the nonzero eigenvalues of
    ``W_E W_OV W_U (I - 11^T / vocab)`` (the final RMSNorm's weight folded into ``W_U``)."""
    W_E = model.model.embed_tokens.weight.double()
    W_U = model.lm_head.weight.double().T * model.model.norm.weight.double()[:, None]
    W_U = W_U - W_U.mean(dim=1, keepdim=True)
    lam = np.linalg.eigvals((W_E @ mla_w_ov(model, layer, head) @ W_U).numpy())
    lam = lam[np.abs(lam) > 1e-8 * np.abs(lam).max()]
    assert len(lam) == model.config.v_head_dim  # a rank-d_v map (the latent rank is larger)
    return float(np.mean(lam.real / np.abs(lam)))


@pytest.mark.parametrize("model_type", LATENT_TYPES)
def test_heads_reproduce_the_latent_attention_output(model_type):
    """The layer's output is ``sum_h A_h v_h W_O^h`` with ``v_h`` from the equations (A: the model's own)."""
    model = make_tiny_model(model_type, seed=3)
    config = model.config
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    blocks = [model.model.layers[i] for i in latent_blocks(config)]
    seen, patterns = attention_io(model, [block.self_attn for block in blocks], ids)
    assert len(patterns) == len(blocks)  # one pattern per latent attention block, in block order
    v = config.v_head_dim
    for layer, block in enumerate(blocks):
        x, y = seen[layer]
        values = mla_values(block.self_attn, config, x)
        W_O = block.self_attn.o_proj.weight.double()
        total = sum(
            patterns[layer][0, h].double() @ values[h] @ W_O[:, h * v : (h + 1) * v].T
            for h in range(config.num_attention_heads)
        )
        torch.testing.assert_close(total, y.double(), rtol=0, atol=1e-5 * y.abs().max().item())
    assert check_decomposition(model).worst < 1e-5


@pytest.mark.parametrize(  # one in the default run (CI's time budget, #52); the others with --run-slow
    "model_type", [t if t == "minicpm3" else pytest.param(t, marks=pytest.mark.slow) for t in LATENT_TYPES]
)
def test_kappa_of_each_head_is_the_definition(model_type):
    model = make_tiny_model(model_type, seed=4)
    weights = extract_weights(model)
    for layer in range(len(latent_blocks(model.config))):
        torch.testing.assert_close(  # the read's W_OV is the composite through the latent
            (weights.W_OV(layer, 0)).double(), mla_w_ov(model, layer, 0), rtol=1e-5, atol=1e-6
        )
        _, kappa, _ = kappa_scores(reduced_ov_layer(weights, layer))
        expected = [reference_kappa(model, layer, h) for h in range(model.config.num_attention_heads)]
        np.testing.assert_allclose(kappa.numpy(), expected, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def latent_build(tiny_fp32_builds):
    return tiny_fp32_builds("deepseek_v3")


@pytest.mark.parametrize(  # one in the default run (CI's time budget, #52); the others with --run-slow
    "model_type", ["deepseek_v3", *(pytest.param(t, marks=pytest.mark.slow) for t in ("kimi_linear", "minicpm3"))]
)
def test_knockout_delta_is_a_plain_forward_with_the_head_zeroed(tiny_fp32_builds, model_type):
    """knockout_scan's delta of L1H2 equals the copy loss of a copy whose ``o_proj`` columns of head 2 are
    zero (head h's output ``A_h v_h``: columns ``h v_head_dim ..``) in the second latent attention block,
    less the intact copy loss (and likewise L0H1)."""
    build = tiny_fp32_builds(model_type)
    scan = knockout_scan(build, SETTINGS, progress=False, replay=True).set_index("head")
    ids = repeat_tokens(build.tokens, SETTINGS.n, SETTINGS.L, SETTINGS.seed)
    offset = bos_offset(build.tokens)
    intact = own_copy_loss(build.model, ids, SETTINGS.L, offset)
    v = build.model.config.v_head_dim
    blocks = latent_blocks(build.model.config)
    for layer, head in ((0, 1), (1, 2)):
        edited = copy.deepcopy(build.model)
        with torch.no_grad():
            edited.model.layers[blocks[layer]].self_attn.o_proj.weight[:, head * v : (head + 1) * v] = 0
        expected = own_copy_loss(edited, ids, SETTINGS.L, offset) - intact
        assert abs(expected) > 2e-4, "the test model is too weak to show a knockout"
        assert scan.loc[f"L{layer}H{head}", "knockout_delta"] == pytest.approx(expected, abs=1e-5)


def test_sparse_indexer_masks_keys_and_the_read_uses_the_masked_pattern():
    """DeepSeek-V3.2: past position ``index_topk`` each query attends to exactly ``index_topk`` keys (the
    indexer's choice, not the causal prefix), and the heads still reproduce the output (the self-check)."""
    model = make_tiny_model("deepseek_v32", seed=3)
    topk = model.config.index_topk
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        patterns = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    for pattern in patterns:
        kept = (pattern[0] > 0).sum(-1)  # (heads, T): keys each query attends to
        assert (kept[:, topk:] == topk).all() and (kept[:, :topk] == torch.arange(1, topk + 1)).all()
    assert check_decomposition(model).worst < 1e-5


def test_minicpm3_multipliers_are_read():
    """MiniCPM3 scales the embedding (scale_emb), each block's write (scale_depth / sqrt(n_blocks)) and the
    logits (1 / logits_scaling): a read that misses one is refused by the self-check."""
    import dataclasses

    model = make_tiny_model("minicpm3", seed=6)
    assert check_decomposition(model).worst < 1e-5
    assert model.model.layers[0].residual_scale != 1 and model.config.logits_scaling != 1
    for corrupt, what in (
        (dict(depth_scale=None), "residual write"),
        (dict(embed_scale=None), "embedding rows"),
        (dict(logit_divisor=None), "tail"),
    ):
        with pytest.raises(DecompositionError, match=what) as error:
            check_decomposition(model, family=dataclasses.replace(family_of(model), **corrupt))
        assert "\n" not in str(error.value) and "'minicpm3'" in str(error.value)


@pytest.mark.parametrize(
    "corrupt",
    [dict(d_head_attr="qk_nope_head_dim"), dict(norm_weight_offset=1.0), dict(latent_norm="q_a_layernorm")],
    ids=["value-columns", "latent-norm-weight", "wrong-latent-norm"],
)
def test_self_check_refuses_a_wrong_latent_read(corrupt):
    import dataclasses

    model = make_tiny_model("deepseek_v3", seed=6)
    with pytest.raises(DecompositionError) as error:
        check_decomposition(model, family=dataclasses.replace(family_of(model), **corrupt))
    assert "\n" not in str(error.value) and "'deepseek_v3'" in str(error.value) and "layer 0" in str(error.value)


def test_latent_attention_refusals_are_one_line():
    with pytest.raises(UnknownFamilyError) as error:
        family_for_config(tiny_config("deepseek_v3", attention_bias=True))
    assert "attention_bias=False" in str(error.value) and "\n" not in str(error.value)
    from transformers import CONFIG_MAPPING

    with pytest.raises(UnknownFamilyError) as error:
        family_for_config(CONFIG_MAPPING["longcat_flash"]())
    assert "two latent attention sublayers per decoder block" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("cache", ["fp8-e4m3", "q4_0"])
def test_kv_cache_build_of_latent_attention_is_refused(latent_build, cache):
    from pytest_circuits.model.kv_cache import attach_kv_cache
    from pytest_circuits.model.kv_formats import split_kv

    with pytest.raises(CircuitsError) as error:
        attach_kv_cache(latent_build, split_kv(f"fp32+kv-{cache}")[1])
    line = str(error.value)
    assert "\n" not in line and "latent" in line and "kv_lora_rank" in line


def test_qk_damage_of_a_latent_head_is_refused():
    """The sensitivity scan's QK damage scales rows of W_Q: a latent attention has none (one line)."""
    from pytest_circuits.run.sensitivity import scale_head_qk

    model = make_tiny_model("deepseek_v3", seed=1)
    with pytest.raises(CircuitsError) as error:
        scale_head_qk(model, 0, 1, 0.5)
    assert "\n" not in str(error.value) and "latent" in str(error.value)
