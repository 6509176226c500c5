"""Hybrid stacks (Mamba / Mamba-2, gated DeltaNet, RG-LRU or short-convolution blocks beside attention
blocks), checked against the equations written out here from the modules' own weights, not through the read.

Which blocks hold attention is read off ``config.layer_types`` here (``"full_attention"``; RecurrentGemma's
local attention ``"sliding_attention"``) and each
attention block's modules are found by name in the model; the read's heads L0, L1, ... must be those
blocks' heads in order. Per head: ``v_h = x W_V^{g(h)} (+ b)`` from ``v_proj``, output
``sum_h A_h v_h W_O^h + b_O`` (``W_O^h``: the output projection's columns ``h d_head ..``), times
Qwen3-Next's gate ``sigmoid(x W_G^h)`` (q_proj's rows ``[q_h | g_h]`` per head) where it has one.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from pytest_circuits.errors import CircuitsError, UnknownFamilyError
from pytest_circuits.model.builds import load_build
from pytest_circuits.model.families import family_for_config, geometry_of
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.selfcheck import check_decomposition
from pytest_circuits.model.weights import extract_weights
from pytest_circuits.record.schema import Geometry as RecordGeometry
from pytest_circuits.rungs.kappa import kappa_scores, reduced_ov_layer
from pytest_circuits.rungs.knockout import knockout_scan
from pytest_circuits.rungs.repeat import bos_offset, repeat_tokens
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.testing import make_tiny_model, save_tiny_model, tiny_config

from .conftest import attention_io
from .test_knockout import own_copy_loss

SETTINGS = RepeatSettings(seed=1, n=3, L=8)
# type: (attention module, output projection, pre-attention norm, final norm, norm scale offset)
HYBRIDS = {
    "bamba": ("self_attn", "o_proj", "input_layernorm", "final_layernorm", 0.0),
    "granitemoehybrid": ("self_attn", "o_proj", "input_layernorm", "norm", 0.0),
    "jamba": ("self_attn", "o_proj", "input_layernorm", "final_layernorm", 0.0),
    "lfm2": ("self_attn", "out_proj", "operator_norm", "embedding_norm", 0.0),
    "lfm2_moe": ("self_attn", "out_proj", "operator_norm", "embedding_norm", 0.0),
    "nemotron_h": ("mixer", "o_proj", "norm", "norm_f", 0.0),
    "qwen3_next": ("self_attn", "o_proj", "input_layernorm", "norm", 1.0),
    "recurrent_gemma": ("temporal_block", "o_proj", "temporal_pre_norm", "final_norm", 1.0),
}


def attention_blocks(config) -> list[int]:
    """The blocks whose ``layer_types`` entry is ``full_attention`` (or ``sliding_attention``: RecurrentGemma)."""
    return [i for i, kind in enumerate(config.layer_types) if kind in ("full_attention", "sliding_attention")]


def _gate(attn, config, x: torch.Tensor) -> torch.Tensor | None:
    """Qwen3-Next's output gate ``sigmoid(x W_G^h)``, ``(heads, T, d_head)``; None for ungated attention."""
    if config.model_type != "qwen3_next":
        return None
    d = config.head_dim
    q = x @ attn.q_proj.weight.double().T
    return torch.sigmoid(q.reshape(x.shape[0], config.num_attention_heads, 2 * d)[..., d:]).transpose(0, 1)


@torch.no_grad()
def per_head_outputs(model, model_type: str, block: int, x: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    """``(heads, T, d_model)``: each head's term of the attention output, from the modules' weights."""
    config = model.config
    attn_name, out_name = HYBRIDS[model_type][:2]
    attn = getattr(model.model.layers[block], attn_name)
    d, heads, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    values = (x @ attn.v_proj.weight.double().T).reshape(x.shape[0], kv, d).transpose(0, 1)  # (kv, T, d)
    W_O = getattr(attn, out_name).weight.double()
    gate = _gate(attn, config, x)
    terms = []
    for h in range(heads):
        z = pattern[h].double() @ values[h // (heads // kv)]
        z = z if gate is None else z * gate[h]
        terms.append(z @ W_O[:, h * d : (h + 1) * d].T)
    return torch.stack(terms)


def output_bias(model, model_type: str, block: int) -> torch.Tensor | float:
    """``b_O`` of the block's output projection (RecurrentGemma has one), else 0."""
    attn_name, out_name = HYBRIDS[model_type][:2]
    bias = getattr(getattr(model.model.layers[block], attn_name), out_name).bias
    return 0.0 if bias is None else bias.double()


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_attention_blocks_are_the_heads_layers_and_reproduce_their_output(model_type):
    model = make_tiny_model(model_type, seed=3)
    blocks = attention_blocks(model.config)
    assert 0 < len(blocks) < model.config.num_hidden_layers  # a real hybrid
    geo = geometry_of(model)
    assert geo.attention_layers == tuple(blocks) and geo.n_layers == len(blocks)
    attn_name = HYBRIDS[model_type][0]
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    modules = [getattr(model.model.layers[b], attn_name) for b in blocks]
    seen, patterns = attention_io(model, modules, ids)
    assert len(patterns) == len(blocks)  # one pattern per attention block, in block order
    for layer, block in enumerate(blocks):
        x, y = seen[layer]
        terms = per_head_outputs(model, model_type, block, x, patterns[layer][0])
        got = terms.sum(0) + output_bias(model, model_type, block)
        torch.testing.assert_close(got, y.double(), rtol=0, atol=1e-5 * y.abs().max().item())
    assert check_decomposition(model).worst < 1e-5


def test_qwen3_next_gate_is_part_of_each_heads_output():
    """Without ``sigmoid(x W_G^h)`` the heads' sum misses the layer's output by far more than rounding."""
    model = make_tiny_model("qwen3_next", seed=3)
    block = attention_blocks(model.config)[0]
    attn = model.model.layers[block].self_attn
    x = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        gate = _gate(attn, model.config, x[0].double())
    assert gate is not None and float(gate.min()) > 0 and float(gate.max()) < 1
    assert float((gate - gate.mean()).abs().max()) > 0.1  # a gate that varies per channel and query


@torch.no_grad()
def reference_kappa(model, model_type: str, layer: int, head: int) -> float:
    """kappa by its definition, from the modules: nonzero eigenvalues of ``W_E W_OV W_U (I - 11^T / vocab)``,
    ``W_OV = diag(g) W_V^{g(h)} W_O^h`` (g: the pre-attention norm's scale, offset + w), ``W_U`` through the
    final norm's scale. Positive multipliers (embedding, residual, logits) are left out: kappa ignores them."""
    config = model.config
    attn_name, out_name, norm_name, final_name, offset = HYBRIDS[model_type]
    blk = model.model.layers[attention_blocks(config)[layer]]
    attn, d = getattr(blk, attn_name), config.head_dim
    group = head // (config.num_attention_heads // config.num_key_value_heads)
    g = getattr(blk, norm_name).weight.double() + offset
    W_V = attn.v_proj.weight.double()[group * d : (group + 1) * d].T * g[:, None]
    W_O = getattr(attn, out_name).weight.double()[:, head * d : (head + 1) * d].T
    g_f = getattr(model.model, final_name).weight.double() + offset
    W_U = model.lm_head.weight.double().T * g_f[:, None]
    W_U = W_U - W_U.mean(dim=1, keepdim=True)
    lam = np.linalg.eigvals((model.get_input_embeddings().weight.double() @ W_V @ W_O @ W_U).numpy())
    lam = lam[np.abs(lam) > 1e-8 * np.abs(lam).max()]
    return float(np.mean(lam.real / np.abs(lam)))


@pytest.mark.parametrize(  # one in the default run (CI's time budget, #52); the others with --run-slow
    "model_type",
    [
        "recurrent_gemma",
        *(pytest.param(t, marks=pytest.mark.slow) for t in ("nemotron_h", "qwen3_next", "bamba", "lfm2")),
    ],
)
def test_kappa_of_each_attention_head_is_the_definition(model_type):
    model = make_tiny_model(model_type, seed=4)
    weights = extract_weights(model)
    for layer in range(geometry_of(model).n_layers):
        _, kappa, _ = kappa_scores(reduced_ov_layer(weights, layer))
        expected = [reference_kappa(model, model_type, layer, h) for h in range(model.config.num_attention_heads)]
        np.testing.assert_allclose(kappa.numpy(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(  # one in the default run (CI's time budget, #52); the others with --run-slow
    "model_type",
    ["nemotron_h", *(pytest.param(t, marks=pytest.mark.slow) for t in ("qwen3_next", "recurrent_gemma", "bamba"))],
)
def test_knockout_delta_is_a_plain_forward_with_the_attention_blocks_head_zeroed(tiny_fp32_builds, model_type):
    """knockout_scan's L{i}H{h} is head h of the i-th attention block: its delta equals the copy loss of a
    copy whose output projection in that block has head h's columns zeroed, less the intact one."""
    build = tiny_fp32_builds(model_type)
    scan = knockout_scan(build, SETTINGS, progress=False, replay=True).set_index("head")
    ids = repeat_tokens(build.tokens, SETTINGS.n, SETTINGS.L, SETTINGS.seed)
    offset = bos_offset(build.tokens)
    intact = own_copy_loss(build.model, ids, SETTINGS.L, offset)
    attn_name, out_name = HYBRIDS[model_type][:2]
    d = build.model.config.head_dim
    for layer, block in enumerate(attention_blocks(build.model.config)):
        head = 1 + layer
        edited = copy.deepcopy(build.model)
        with torch.no_grad():
            getattr(getattr(edited.model.layers[block], attn_name), out_name).weight[:, head * d : (head + 1) * d] = 0
        expected = own_copy_loss(edited, ids, SETTINGS.L, offset) - intact
        assert abs(expected) > 2e-4, "the test model is too weak to show a knockout"
        assert scan.loc[f"L{layer}H{head}", "knockout_delta"] == pytest.approx(expected, abs=1e-5)


def test_the_record_names_the_attention_blocks(tmp_path, capsys):
    """`circuits scan --json` of a hybrid: geometry.attention_layers lists the attention blocks, its heads
    are those blocks' (n_layers = their count), and the record validates."""
    from pytest_circuits.cli import main
    from pytest_circuits.record.schema import Record

    folder = save_tiny_model("nemotron_h", tmp_path / "m", seed=2, initializer_range=0.2)
    out = tmp_path / "scan.json"
    assert (
        main(["scan", str(folder), "--device", "cpu", "--probe-n", "2", "--probe-length", "4", "--json", str(out)]) == 0
    )
    record = json.loads(out.read_text())
    Record.model_validate(record)
    geometry = record["model"]["geometry"]
    assert geometry["attention_layers"] == attention_blocks(tiny_config("nemotron_h")) == [1, 4]
    assert geometry["n_layers"] == 2 and len(record["heads"]) == 2 * geometry["n_heads"]
    assert "hybrid" in record["model"]["quirks"]
    assert "hybrid: L0-L1 are blocks [1, 4], the other blocks no attention" in capsys.readouterr().out


@pytest.mark.parametrize("blocks", [[1], [3, 1], [-1, 2]])
def test_record_geometry_refuses_attention_layers_that_do_not_fit(blocks):
    from pydantic import ValidationError

    fields = dict(n_layers=2, n_heads=4, n_kv_heads=2, d_model=64, d_head=16, vocab=128)
    assert RecordGeometry(**fields, attention_layers=[1, 3]).attention_layers == [1, 3]
    with pytest.raises(ValidationError, match="attention_layers"):
        RecordGeometry(**fields, attention_layers=blocks)


def test_a_stack_without_softmax_attention_is_refused_in_one_line():
    config = tiny_config("qwen3_next", layer_types=["linear_attention"] * 4)
    with pytest.raises(UnknownFamilyError) as error:
        geometry_of(make_tiny_model("qwen3_next", seed=0, layer_types=["linear_attention"] * 4))
    line = str(error.value)
    assert "\n" not in line and "no softmax heads" in line and "'qwen3_next'" in line
    family_for_config(config)  # the type is read; this config has nothing to read


@pytest.mark.parametrize(
    "model_type, why",
    [
        ("zamba2", "never the residual stream"),
        ("zamba", "never the residual stream"),
        ("minimax", "renormalise the residual stream itself"),
    ],
)
def test_remaining_hybrids_are_refused_naming_why_and_their_attention_layers(model_type, why):
    from transformers import CONFIG_MAPPING

    with pytest.raises(UnknownFamilyError) as error:
        family_for_config(CONFIG_MAPPING[model_type]())
    line = str(error.value)
    assert "\n" not in line and why in line and f"{model_type!r} has no per-head OV map" in line
    assert "; attention layers [" in line and "], other layers [" in line


def test_recurrent_gemma_embedding_scale_is_the_models_bfloat16_normalizer():
    """RecurrentGemma multiplies the embedding by ``sqrt(d_model)`` rounded to bfloat16 (its ``normalizer``):
    at d_model 80, 8.9375 rather than 8.944. Block 0's inputs for two sequences differ by the read's
    ``W_E`` rows, and the self-check passes, at that width."""
    model = make_tiny_model("recurrent_gemma", seed=4, hidden_size=80, lru_width=80)
    scale = float(torch.tensor(80**0.5, dtype=torch.bfloat16))
    assert abs(scale - 80**0.5) > 5e-3
    W_E = extract_weights(model).W_E.double()
    torch.testing.assert_close(W_E, model.model.embed_tokens.weight.double() * scale, rtol=1e-6, atol=0)
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda m, a, k: seen.append(a[0] if a else k["activations"]), with_kwargs=True
    )
    ids1, ids2 = torch.randint(0, 128, (2, 1, 10), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            model(input_ids=ids1, use_cache=False)
            model(input_ids=ids2, use_cache=False)
    finally:
        hook.remove()
    torch.testing.assert_close((seen[0] - seen[1])[0].double(), W_E[ids1[0]] - W_E[ids2[0]], rtol=1e-5, atol=1e-5)
    assert check_decomposition(model).worst < 1e-5


def test_kv_cache_on_a_hybrid_quantizes_the_attention_blocks_only(tmp_path):
    """``+kv-`` puts the cache in the attention blocks' path (their keys and values); the Mamba blocks'
    state is no KV cache and stays as the model computes it."""
    from pytest_circuits.model.kv_cache import CACHE_ATTR, attach_kv_cache
    from pytest_circuits.model.kv_formats import split_kv

    folder = save_tiny_model("nemotron_h", tmp_path / "m", seed=2)
    served = attach_kv_cache(load_build(resolve_model(str(folder)), "fp32", "cpu"), split_kv("fp32+kv-fp8-e4m3")[1])
    holders = [i for i, block in enumerate(served.model.model.layers) if hasattr(block.mixer, CACHE_ATTR)]
    assert holders == attention_blocks(served.model.config)
    assert "fp8" in served.identity.kv_cache


def test_circuits_errors_are_one_line_for_the_atp_star_screen_on_a_hybrid(tiny_fp32_builds):
    from pytest_circuits.rungs.screen import atp_star

    build = tiny_fp32_builds("nemotron_h")
    with pytest.raises(CircuitsError) as error:
        atp_star(build, torch.zeros(1, 4, dtype=torch.long), 2, "zero", None, 1)
    assert "\n" not in str(error.value) and "hybrid" in str(error.value)


def test_falcon_h1_block_writes_attention_heads_plus_mamba():
    """Falcon-H1: every block runs Mamba beside attention on the same normed input. What a block adds
    before its MLP, ``mid - pre``, is ``m_out sum_h A_h (m_in norm(x) W_V) W_O^h + m_ssm mamba(norm(x))``,
    the heads' terms from the modules' weights; the read's heads are every block's."""
    model = make_tiny_model("falcon_h1", seed=3)
    config = model.config
    assert geometry_of(model).attention_layers is None and geometry_of(model).n_layers == config.num_hidden_layers
    seen: dict[str, torch.Tensor] = {}
    block = model.model.layers[1]

    def keep(key: str, value: torch.Tensor) -> None:
        seen.setdefault(key, value[0])

    hooks = [
        block.register_forward_pre_hook(
            lambda m, a, k: keep("pre", a[0] if a else k["hidden_states"]), with_kwargs=True
        ),
        block.input_layernorm.register_forward_hook(lambda m, a, out: keep("normed", out)),
        block.mamba.register_forward_hook(lambda m, a, out: keep("mamba", out)),
        block.pre_ff_layernorm.register_forward_pre_hook(lambda m, a: keep("mid", a[0])),
    ]
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            pattern = model(input_ids=ids, output_attentions=True, use_cache=False).attentions[1][0]
    finally:
        for hook in hooks:
            hook.remove()
    x = seen["normed"].double() * config.attention_in_multiplier
    attn, d, group = block.self_attn, config.head_dim, config.num_attention_heads // config.num_key_value_heads
    values = (x @ attn.v_proj.weight.double().T).reshape(12, -1, d).transpose(0, 1)
    W_O = attn.o_proj.weight.double()
    heads = sum(
        pattern[h].double() @ values[h // group] @ W_O[:, h * d : (h + 1) * d].T
        for h in range(config.num_attention_heads)
    )
    write = heads * config.attention_out_multiplier + seen["mamba"].double() * config.ssm_out_multiplier
    got = seen["mid"].double() - seen["pre"].double()
    torch.testing.assert_close(write, got, rtol=0, atol=1e-5 * got.abs().max().item())
    assert float(seen["mamba"].abs().max()) > 0 and check_decomposition(model).worst < 1e-4


def test_zamba2_shared_attention_never_writes_into_the_residual_stream():
    """Why zamba2 is refused, from its forward: with the Mamba mixer's output projection zeroed, a hybrid
    block's output is its input exactly, though its shared attention block ran and gave a nonzero output:
    the attention's output only feeds the Mamba mixer's input, so no head has a residual write to read."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING["zamba2"](
        **dict(bos_token_id=None, eos_token_id=None, pad_token_id=None),
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=128,
        mamba_d_state=8,
        mamba_headdim=16,
        n_mamba_heads=8,
        mamba_ngroups=1,
        num_mem_blocks=1,
        adapter_rank=8,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    block = model.model.layers[1]
    with torch.no_grad():
        block.mamba_decoder.mamba.out_proj.weight.zero_()
    seen: dict[str, torch.Tensor] = {}

    def keep(key: str, value) -> None:
        seen.setdefault(key, value[0] if isinstance(value, tuple) else value)

    hooks = [
        block.register_forward_pre_hook(
            lambda m, a, k: keep("in", a[0] if a else k["hidden_states"]), with_kwargs=True
        ),
        block.register_forward_hook(lambda m, a, out: keep("out", out)),
        block.shared_transformer.register_forward_hook(lambda m, a, out: keep("attention", out)),
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0)), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert float(seen["attention"].abs().max()) > 1e-3
    assert torch.equal(seen["out"], seen["in"])
