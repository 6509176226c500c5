"""Every model type of the family table, each a tiny random model built here from its transformers config.

Per type: the per-head read reproduces the attention output (an explicit loop over heads, on
the pattern the model returns with ``output_attentions``); the embedding read matches what
the model adds to its residual stream; a head whose OV is set to a copying map scores kappa
near +1 and flips under negation; the repeat probe runs with a finite copy loss; cached
knockout deltas equal the plain loop. Then the refusals: a corrupted read, a type with no
per-head OV map, an unlisted type recognised by layout, an entry-point plugin.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

from pytest_circuits.errors import UnknownFamilyError
from pytest_circuits.model import families, family_resolution, family_table
from pytest_circuits.model.builds import load_build
from pytest_circuits.model.families import (
    LLAMA,
    attention_block,
    families_markdown,
    family_for_config,
    family_of,
    geometry_of,
    get_module,
    layer_modules,
    out_proj_module,
    supported_model_types,
)
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.selfcheck import DecompositionError, check_decomposition, measure_decomposition
from pytest_circuits.model.weights import extract_weights
from pytest_circuits.rungs.kappa import kappa_scores, reduced_ov_layer
from pytest_circuits.rungs.knockout import knockout_scan
from pytest_circuits.rungs.plain_loops import plain_kappa, plain_reduced_ov
from pytest_circuits.rungs.probe import run_repeat_probe
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.testing import (
    TINY_VARIANTS,
    make_tiny_model,
    negate_head_ov,
    save_tiny_model,
    tiny_config,
    tiny_model_types,
)

from .conftest import read_v_heads_rolled
from .test_hybrid_stacks import HYBRIDS, _gate
from .test_latent_attention import LATENT_TYPES, mla_values

TYPES = tiny_model_types()
ISSUE_TYPES = (
    "gpt2 gpt_neo gptj gpt_bigcode gpt_neox opt bloom falcon llama mistral mixtral ministral qwen2 qwen2_moe "
    "qwen3 qwen3_moe gemma gemma2 gemma3_text phi phi3 olmo olmo2 olmoe stablelm cohere granite starcoder2 "
    "smollm3 helium glm internlm3 gpt_oss"
).split()
SETTINGS = RepeatSettings(seed=1, n=3, L=8)
DEFAULT_RUN = (
    "gpt2",
    "bloom",
    "gemma2",
    "gpt_oss",
    "granite",
    "olmo2",
    "falcon-new-decoder",
    "gpt_bigcode",
    "deepseek_v3",
)
"""Types whose probe and knockout run in the default suite: one per mechanism (learned positions,
ALiBi, sandwich norm + soft cap + sliding window, sinks + MoE, multipliers, no pre-norm, grouped
fused QKV, multi-query, latent attention; hybrid stacks' knockouts: tests/test_hybrid_stacks.py);
the others run with --run-slow."""
PROBE_TYPES = [t if t in DEFAULT_RUN else pytest.param(t, marks=pytest.mark.slow) for t in TYPES]
OWN_REFERENCE = {*LATENT_TYPES, *HYBRIDS, "falcon_h1"}
"""Types whose attention output is reproduced from the equations in their own test file
(tests/test_latent_attention.py, tests/test_hybrid_stacks.py), self-check included: the loop below
runs them with --run-slow."""
LOOP_TYPES = [pytest.param(t, marks=pytest.mark.slow) if t in OWN_REFERENCE else t for t in TYPES]


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """``tiny_build(type)``: a saved tiny model of ``type`` loaded with `load_build` (which runs the self-check)."""
    made = {}

    def make(model_type: str):
        if model_type not in made:
            folder = save_tiny_model(model_type, tmp_path_factory.mktemp(model_type), seed=2, initializer_range=0.2)
            made[model_type] = load_build(resolve_model(str(folder)), "fp32", "cpu")
        return made[model_type]

    return make


# ---------------------------------------------------------------- the table


def test_table_claims_only_types_the_suite_builds():
    """Every claimed model type is built below, from its own config, and the issue's types are all claimed."""
    built = {tiny_config(t).model_type for t in TYPES}
    assert set(supported_model_types()) <= built
    assert set(ISSUE_TYPES) <= set(supported_model_types())
    for family in families.FAMILIES:  # every config variant of the table is one of the built variants
        if family.when:
            assert any(
                tiny_config(t).model_type in family.model_types and family.matches(tiny_config(t)) for t in TYPES
            ), family.when


def test_every_claimed_type_exists_in_installed_transformers():
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type in supported_model_types():
        assert model_type in CONFIG_MAPPING and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, model_type


def test_docs_table_is_the_code_table():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs" / "families.md"
    assert families_markdown() in docs.read_text(), "regenerate docs/families.md from families_markdown()"


def test_quirk_tags_are_defined():
    for family in families.FAMILIES:
        assert set(family.quirks) <= set(families.QUIRKS), family.model_types


# ---------------------------------------------------------------- per type


def _loop_attention_output(model, layer: int, ids: torch.Tensor):
    """``(expected, actual)``: ``sum_h A_h (X W_V + b_V) W_O + b_O`` by a loop over heads vs the module's output."""
    fam, geo = family_of(model), geometry_of(model)
    weights = extract_weights(model, fold=False)
    lw = weights.layers[layer]
    block = attention_block(model, layer)
    attn = get_module(block, fam.attn)
    seen = {}

    def before(module, args, kwargs):
        seen.setdefault("x", kwargs.get("hidden_states", args[0] if args else None))
        if fam.attn_adds_residual:
            seen.setdefault("res", kwargs.get(fam.attn_adds_residual, args[1] if len(args) > 1 else None))

    def after(module, args, output):
        seen.setdefault("y", output[0])

    handles = [attn.register_forward_pre_hook(before, with_kwargs=True), attn.register_forward_hook(after)]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    x, pattern = seen["x"][0].double(), out.attentions[layer][0].double()
    total = torch.zeros(x.shape[0], geo.d_model, dtype=torch.float64)
    latent = mla_values(attn, model.config, x) if fam.latent_norm else None  # tests/test_latent_attention.py
    gate = _gate(attn, model.config, x)  # Qwen3-Next's output gate (tests/test_hybrid_stacks.py)
    for h in range(geo.n_heads):
        v = x @ weights.W_V_of(layer, h).double() if latent is None else latent[h]
        if lw.b_V is not None:
            v = v + lw.b_V[geo.kv_group(h)].double()
        z = pattern[h] @ v
        total += (z if gate is None else z * gate[h]) @ lw.W_O[h].double()
    if lw.b_O is not None:
        total += lw.b_O.double()
    if fam.attn_adds_residual:
        total += seen["res"][0].double()
    return total, seen["y"][0].double()


@pytest.mark.parametrize("model_type", LOOP_TYPES)
def test_heads_sum_to_attention_output(model_type):
    model = make_tiny_model(model_type, seed=3)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    for layer in range(geometry_of(model).n_layers):
        expected, actual = _loop_attention_output(model, layer, ids)
        torch.testing.assert_close(expected, actual, rtol=0, atol=1e-5 * max(1.0, actual.abs().max().item()))
    check = check_decomposition(model)
    assert len(check.errors) == geometry_of(model).n_layers and check.worst < check.tolerance


@pytest.mark.parametrize("model_type", TYPES)
def test_embedding_read_is_what_tokens_add(model_type):
    """Two token sequences at the same positions: block 0's inputs differ by ``W_E[ids1] - W_E[ids2]``."""
    model = make_tiny_model(model_type, seed=4)
    W_E = extract_weights(model).W_E.double()
    gen = torch.Generator().manual_seed(1)
    ids1, ids2 = torch.randint(0, 128, (2, 1, 10), generator=gen)
    seen = []
    hook = layer_modules(model)[0].register_forward_pre_hook(
        lambda m, a, k: seen.append(k.get("hidden_states", a[0] if a else None)), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(input_ids=ids1, use_cache=False)
            model(input_ids=ids2, use_cache=False)
    finally:
        hook.remove()
    got = (seen[0] - seen[1])[0].double()
    torch.testing.assert_close(got, W_E[ids1[0]] - W_E[ids2[0]], rtol=1e-5, atol=1e-5)


def _expected_fold(model, layer: int) -> torch.Tensor:
    """What folding must multiply each output column of ``W_O`` by, found from the running model, not
    from the read: the norm that receives the output projection's output (a sandwich or post norm;
    its scale ``offset + w`` read off its output on a large constant input), else ones; times the
    config's ``residual_multiplier`` or ``attention_out_multiplier`` where it has one (the attention
    output's multiplier), and the block's own ``residual_scale`` (MiniCPM3)."""
    block, proj = attention_block(model, layer), out_proj_module(model, layer)
    produced: list[torch.Tensor] = []
    receivers: list[torch.nn.Module] = []

    def keep(module, args, out):
        produced.append(out)  # kept alive: its memory is not reused by a later module's input

    def check(module, args, kwargs):
        first = args[0] if args else next(iter(kwargs.values()), None)
        if torch.is_tensor(first) and produced and first.data_ptr() == produced[-1].data_ptr():
            receivers.append(module)

    handles = [proj.register_forward_hook(keep)]
    handles += [m.register_forward_pre_hook(check, with_kwargs=True) for m in block.modules() if m is not proj]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    d_model = proj.weight.shape[1] if type(proj).__name__ == "Conv1D" else proj.weight.shape[0]
    norms = [m for m in receivers if "norm" in type(m).__name__.lower()]
    scale = torch.ones(d_model, dtype=torch.float64)
    if norms:
        c = 1e3  # RMSNorm(c 1) = g c / sqrt(c^2 + eps): g to float round-off
        with torch.no_grad():
            scale = norms[0](torch.full((1, 1, d_model), c)).reshape(-1).double()
    config = model.config
    depth = float(getattr(block, "residual_scale", 1.0))  # MiniCPM3's block multiplies its writes by it
    return (
        scale
        * depth
        * float(getattr(config, "residual_multiplier", None) or getattr(config, "attention_out_multiplier", 1.0))
    )


def _copying_head(model, layer: int, head: int) -> None:
    """Set the raw ``W_O`` of one head so that its folded reduced OV ``M = B^T diag(p)^2 B`` is positive definite.

    ``B = W_U W_E W_V`` (folded); ``p`` is what folding multiplies each output column of ``W_O`` by
    (sandwich norm weight, output multiplier: 1 for most families), from the model (`_expected_fold`),
    and the read's fold is checked to be it.
    """
    folded = extract_weights(model, fold=True)
    raw = extract_weights(model, fold=False)
    B = (folded.W_U @ folded.W_E @ folded.W_V_of(layer, head)).double()  # (d_model, d_head)
    W_o_raw, W_o_fold = raw.layers[layer].W_O[head].double(), folded.layers[layer].W_O[head].double()
    p = _expected_fold(model, layer)
    torch.testing.assert_close(W_o_fold, W_o_raw * p, rtol=1e-5, atol=1e-6)  # the read folds what the model does
    new = (B * p[:, None]).T  # (d_head, d_model) raw W_O
    geo = folded.geometry
    proj = out_proj_module(model, layer)
    cols = slice(head * geo.d_head, (head + 1) * geo.d_head)
    with torch.no_grad():
        if type(proj).__name__ == "Conv1D":
            proj.weight[cols, :] = new.to(proj.weight.dtype)
        else:
            proj.weight[:, cols] = new.T.to(proj.weight.dtype)


@pytest.mark.parametrize("model_type", TYPES)
def test_copying_head_scores_plus_one_and_flips(model_type):
    model = make_tiny_model(model_type, seed=5)
    layer, head = 1, 1
    _copying_head(model, layer, head)
    for sign in (1, -1):
        weights = extract_weights(model)
        _, kappa, trace = kappa_scores(reduced_ov_layer(weights, layer))
        ref_kappa, ref_trace = plain_kappa(plain_reduced_ov(weights, layer, head))
        assert sign * kappa[head].item() > 0.99 and sign * trace[head].item() > 0.99
        assert kappa[head].item() == pytest.approx(ref_kappa, abs=1e-6)
        assert trace[head].item() == pytest.approx(ref_trace, abs=1e-6)
        negate_head_ov(model, layer, head)


@pytest.mark.parametrize("model_type", PROBE_TYPES)
def test_probe_and_replayed_knockout(tiny_build, model_type):
    build = tiny_build(model_type)
    probe = run_repeat_probe(build, SETTINGS)
    assert math.isfinite(probe.copy_loss) and math.isfinite(probe.first_copy_loss)
    assert len(probe.heads) == build.geometry.n_layers * build.geometry.n_heads
    replayed = knockout_scan(build, SETTINGS, progress=False, replay=True)
    plain = knockout_scan(build, SETTINGS, progress=False, replay=False)
    assert replayed.attrs["copy_loss"] == pytest.approx(plain.attrs["copy_loss"], abs=1e-6)
    np.testing.assert_allclose(replayed.knockout_delta, plain.knockout_delta, rtol=0, atol=1e-5)
    assert plain.knockout_delta.abs().max() > 1e-3  # the knockouts really changed something


# ---------------------------------------------------------------- refusals


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    "model_type, corrupt",
    [
        ("gpt_neox", dict(qkv_layout="fused_split")),  # a wrong Q/K/V layout
        ("qwen2", dict(qkv=("q_proj", "v_proj", "k_proj"))),  # K read as V
        ("falcon-new-decoder", dict(qkv_layout="fused_split")),
        ("gemma", dict(norm_weight_offset=0.0)),  # Gemma's (1 + w) read as w
        ("gemma2", dict(post_attn_norm=None, norm_weight_offset=0.0)),
        ("bloom", dict(attn_adds_residual=None)),  # the residual BLOOM adds inside its attention
        ("olmo2", dict(attn_norm="post_attention_layernorm")),  # a norm the attention does not read
    ],
)
def test_self_check_refuses_a_wrong_read(model_type, corrupt):
    model = make_tiny_model(model_type, seed=6)
    wrong = dataclasses.replace(family_of(model), **corrupt)
    with pytest.raises(DecompositionError) as error:
        check_decomposition(model, family=wrong)
    line = _one_line(error)
    assert repr(model.config.model_type) in line and "layer 0" in line and "relative error" in line


def test_self_check_refuses_swapped_heads(monkeypatch):
    """A read that puts the K/V heads in the wrong order (rolled by one) is refused."""
    model = make_tiny_model("llama", seed=7)
    assert check_decomposition(model).ok
    read_v_heads_rolled(monkeypatch)
    with pytest.raises(DecompositionError, match=r"'llama'.*layer 0"):
        check_decomposition(model)


def test_load_build_runs_the_self_check(tmp_path, monkeypatch):
    folder = save_tiny_model("gpt_neox", tmp_path / "m", seed=1)
    load_build(resolve_model(str(folder)), "fp32", "cpu")  # the right read loads
    wrong = tuple(
        dataclasses.replace(f, qkv_layout="fused_split") if "gpt_neox" in f.model_types else f
        for f in families.FAMILIES
    )
    monkeypatch.setattr(family_table, "FAMILIES", wrong)
    with pytest.raises(DecompositionError, match="'gpt_neox'"):
        load_build(resolve_model(str(folder)), "fp32", "cpu")


@pytest.mark.parametrize("recipe, dtype", [("bf16", "bfloat16"), ("fp16", "float16"), ("bnb-int8", "float32")])
def test_self_check_tolerance_by_build(tiny_folder, recipe, dtype):
    """Low-precision builds pass within their stated tolerance, which is far below a wrong read's error."""
    build = load_build(resolve_model(tiny_folder("llama")), recipe, "cpu")
    check = measure_decomposition(build)
    assert check.dtype == dtype and check.worst <= check.tolerance
    wrong = dataclasses.replace(build.family, qkv=("q_proj", "v_proj", "k_proj"))  # K read as V
    assert min(measure_decomposition(build, family=wrong).errors) > 10 * check.tolerance


def test_no_per_head_ov_types_get_one_line():
    from transformers import CONFIG_MAPPING

    with pytest.raises(UnknownFamilyError) as error:
        family_for_config(CONFIG_MAPPING["mamba"](hidden_size=16, num_hidden_layers=2, vocab_size=32))
    assert "state-space" in _one_line(error)
    with pytest.raises(UnknownFamilyError) as error:
        family_for_config(CONFIG_MAPPING["longcat_flash"]())
    assert "latent attention" in _one_line(error)


def test_hybrid_stack_names_its_attention_layers():
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING["jamba"](num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1)
    assert families.family_and_geometry(config)[1].attention_layers == (1, 3)


def test_unlisted_type_with_a_known_layout_is_recognised():
    """An installed model type nobody listed, with Llama's module names: the llama layout is assumed, said once."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    assert "arcee" not in supported_model_types()
    config = CONFIG_MAPPING["arcee"](
        **{
            k: v
            for k, v in tiny_config("llama").to_dict().items()
            if k
            in (
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "hidden_size",
                "intermediate_size",
                "vocab_size",
                "max_position_embeddings",
            )
        }
    )
    family_resolution._WARNED.discard("arcee")
    with pytest.warns(UserWarning, match="assumed the 'llama' layout"):
        family = family_for_config(config)
    assert family.assumed and family.name == "llama" and family.model_types == ("arcee",)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per type, not on every lookup
        assert family_of(model).assumed
    assert check_decomposition(model).ok


def test_unlisted_type_with_no_known_layout_lists_the_supported():
    from transformers import CONFIG_MAPPING

    with pytest.raises(UnknownFamilyError) as error:
        family_for_config(CONFIG_MAPPING["openai-gpt"](n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    line = _one_line(error)
    assert "'openai-gpt' is not supported" in line and "gemma3_text" in line and "pytest_circuits.families" in line


ACME = LLAMA.for_type("acme_llama", quirks=("grouped_query",))
"""A family a third-party package would declare under the ``pytest_circuits.families`` entry point."""


def test_entry_point_families_are_loaded(monkeypatch):
    import importlib.metadata

    point = importlib.metadata.EntryPoint(name="acme", value=f"{__name__}:ACME", group=families.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [point] if group == point.group else [])
    monkeypatch.setattr(family_resolution, "_PLUGINS", None)
    assert "acme_llama" in supported_model_types()
    model = make_tiny_model("llama", seed=8)
    model.config.model_type = "acme_llama"
    assert family_of(model) is ACME
    assert check_decomposition(model).ok
    monkeypatch.setattr(family_resolution, "_PLUGINS", None)
    broken = importlib.metadata.EntryPoint(name="broken", value=f"{__name__}:NOT_THERE", group=point.group)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [broken])
    with pytest.raises(UnknownFamilyError, match="family plugin 'broken'"):
        supported_model_types()
    monkeypatch.setattr(family_resolution, "_PLUGINS", None)


def test_variant_names_are_types_plus_variants():
    for name, (model_type, _) in TINY_VARIANTS.items():
        assert name.startswith(model_type) and model_type in supported_model_types()


# ---------------------------------------------------------------- GGUF round trips

GGUF_TOKENS = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(125)]
GGUF_ROUND_TRIPS = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=128),  # the GGUF keys carry no head_dim: transformers assumes Qwen3's 128
    "gpt2": dict(n_positions=1024),  # ... nor GPT-2's n_positions (1024 assumed)
    "falcon": {},
    "stablelm": {},
    "starcoder2": {},
    # ... nor Gemma's query_pre_attn_scalar (256 assumed) or Gemma 3's final soft cap; embeddings tied
    "gemma2": dict(tie_word_embeddings=True, query_pre_attn_scalar=256),
    "gemma3_text": dict(tie_word_embeddings=True, query_pre_attn_scalar=256, final_logit_softcapping=None),
    "bloom": {},  # its post-attention norm is blk.N.ffn_norm (testing.GGUF_EXTRA_LAYER_NAMES)
    "phi3": dict(vocab_size=32064),  # the loader's default pad id 32000 needs a 32k vocabulary
    # the loader reads no expert sizes (transformers' defaults assumed), and Qwen3-MoE's normalised top-k
    "qwen2_moe": dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
    "qwen3_moe": dict(head_dim=128, moe_intermediate_size=768, norm_topk_prob=True),
}
"""Architectures that transformers' GGUF loader maps and that round-trip from a GGUFWriter file here
(MoE experts stacked per layer as llama.cpp writes them). Not round-tripped: mistral (llama.cpp
writes it as llama: it loads as the llama type)."""


GGUF_SLOW = ("phi3",)  # a 32k-token vocabulary: transformers' tokenizer conversion takes most of 30 s


@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=pytest.mark.slow) if t in GGUF_SLOW else t for t in GGUF_ROUND_TRIPS]
)
def test_gguf_round_trip(tmp_path, monkeypatch, model_type):
    from pytest_circuits.testing import write_tiny_gguf

    monkeypatch.setenv("PYTEST_CIRCUITS_CACHE", str(tmp_path / "cache"))
    model = make_tiny_model(model_type, seed=9, **GGUF_ROUND_TRIPS[model_type])
    tokens = GGUF_TOKENS + [f"t{i}" for i in range(len(GGUF_TOKENS) - 3, model.config.vocab_size - 3)]
    path = write_tiny_gguf(model, tmp_path / f"{model_type}.gguf", tokens=tokens, bos_id=1)
    source = resolve_model(str(path))
    assert source.kind == "gguf" and (source.folder / "model.safetensors").is_file()
    build = load_build(source, "fp32", "cpu")  # runs the self-check
    assert build.model.config.model_type == model_type
    assert build.tokens.bos_id == 1  # BOS as the file says
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(build.model(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    assert resolve_model(str(path)).folder == source.folder  # the cached conversion is reused


def test_recognised_layout_that_reads_wrong_is_refused(monkeypatch):
    """Nemotron without its table entry: Llama's module names but a (1 + w) LayerNorm, assumed llama, then
    refused by the self-check."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    monkeypatch.setattr(
        family_table, "FAMILIES", tuple(f for f in families.FAMILIES if "nemotron" not in f.model_types)
    )

    config = CONFIG_MAPPING["nemotron"](
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert family_for_config(config).assumed
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for block in layer_modules(model):
            block.input_layernorm.weight.normal_(0.0, 0.3)  # stored w; the model scales by 1 + w
    with pytest.raises(DecompositionError) as error:
        check_decomposition(model)
    assert "'nemotron'" in _one_line(error) and "pre-attention norm" in _one_line(error)


# ---------------------------------------------------------------- sliding windows and the probe

WINDOWED = [  # (type, config overrides giving a window of 4, the layers that slide)
    ("mistral", {"sliding_window": 4}, [0, 1]),
    ("gemma2", {"sliding_window": 4}, [0]),
    ("gpt_oss", {"sliding_window": 4}, [0]),
    ("gpt_neo", {"window_size": 4}, [1]),
    ("qwen2", {"sliding_window": 4, "use_sliding_window": False}, []),
]


@pytest.mark.parametrize("model_type, overrides, sliding", WINDOWED, ids=[w[0] for w in WINDOWED])
def test_attention_windows_are_the_masks_the_model_applies(model_type, overrides, sliding):
    """The windows read from the config are the model's own: on 12 tokens, eager attention puts
    no weight at distance >= 4 in exactly the layers `attention_windows` names."""
    model = make_tiny_model(model_type, seed=0, **overrides)
    assert families.attention_windows(model.config) == dict.fromkeys(sliding, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    distance = torch.arange(12)[:, None] - torch.arange(12)[None, :]
    for layer, pattern in enumerate(attentions):
        beyond = pattern[0][:, distance >= 4]
        assert (beyond.abs().max() == 0) == (layer in sliding), layer


def test_probe_longer_than_a_sliding_window_is_one_line(tmp_path):
    from pytest_circuits.errors import CircuitsError
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    folder = save_tiny_model("gemma2", tmp_path / "gemma2", sliding_window=8)

    def session(L):
        return Run(CircuitsSettings(model=str(folder), device="cpu", probe=RepeatSettings(0, 2, L)))

    with pytest.raises(CircuitsError) as refused:
        session(5).loaded.preflight()
    assert str(refused.value) == (
        "probe length L=5 needs 10 positions but layer(s) 0 of this model attend within a sliding window of "
        "8 positions; use --circuits-probe-length 4 or less, so that every layer sees the whole probe"
    )
    fits = session(4)
    fits.loaded.preflight()
    assert math.isfinite(fits.measured.repeat_probe("fp32").copy_loss)


# ---------------------------------------------------------------- the front ends on every type

FRONT_PROBE = {"probe-n": "2", "probe-length": "4"}
PYTEST_RUN = ("bloom", "gemma2", "gpt_oss", "falcon-new-decoder", "deepseek_v3", "nemotron_h")
"""Types that `pytest probes` records and gates in the default suite (ALiBi with a fused per-head
QKV; sandwich norm, soft caps and sliding window; sinks and MoE; grouped fused QKV; latent
attention; a hybrid stack); the others run with --run-slow (gpt2 runs in tests/test_plugin.py)."""
PYTEST_TYPES = [t if t in PYTEST_RUN else pytest.param(t, marks=pytest.mark.slow) for t in TYPES]


@pytest.fixture(scope="module")
def saved_type(tmp_path_factory):
    """``saved_type(type)``: a tiny random model of ``type`` saved to a folder, once per module."""
    made = {}

    def make(model_type: str):
        if model_type not in made:
            folder = tmp_path_factory.mktemp(f"front-{model_type}") / model_type
            made[model_type] = save_tiny_model(model_type, folder, seed=2, initializer_range=0.2)
        return made[model_type]

    return make


def _scan(folder, json_path) -> dict:
    """``circuits scan FOLDER --json FILE`` in this process (the CLI's main); the record it wrote."""
    import json

    from pytest_circuits.cli import main

    words = [w for name, value in FRONT_PROBE.items() for w in (f"--{name}", value)]
    rc = main(["scan", str(folder), "--device", "cpu", *words, "--json", str(json_path)])
    assert rc == 0
    return json.loads(json_path.read_text())


@pytest.mark.parametrize("model_type", TYPES)
def test_circuits_scan_runs_on_every_type(saved_type, model_type, tmp_path, capsys):
    from pytest_circuits.record.schema import Record

    folder = saved_type(model_type)
    record = _scan(folder, tmp_path / "scan.json")
    printed = capsys.readouterr().out
    Record.model_validate(record)
    geo = record["model"]["geometry"]
    assert len(record["heads"]) == geo["n_layers"] * geo["n_heads"]
    assert record["rung1"]["unembedding"] == "centred"
    assert math.isfinite(record["copy_loss"])
    assert all(math.isfinite(h["kappa"]) and h["knockout_delta"] is not None for h in record["heads"])
    assert sum(line.startswith("L") and "H" in line.split()[0] for line in printed.splitlines()) == len(record["heads"])


@pytest.mark.parametrize("model_type", PYTEST_TYPES)
def test_pytest_probes_record_then_gate_on_the_type(saved_type, model_type, pytester, tmp_path):
    """``pytest probes --circuits-model FOLDER --circuits-builds fp32 --circuits-update``, then the
    same run without ``--circuits-update`` gates against what it wrote: nothing fails."""

    folder = saved_type(model_type)
    _scan(folder, tmp_path / "warm.json")  # imports every module the inner runs use (pytester drops new ones)
    from .conftest import PROBES as probes

    for test in sorted(probes.glob("test_*.py")):
        pytester.makepyfile(**{test.stem: test.read_text()})
    baselines = tmp_path / "baselines"
    flags = ["--circuits-model", str(folder), "--circuits-builds", "fp32", "--circuits-baselines", str(baselines)]
    flags += ["--circuits-device", "cpu"] + [w for n, v in FRONT_PROBE.items() for w in (f"--circuits-{n}", v)]
    recorded = pytester.runpytest("-p", "no:cacheprovider", *flags, "--circuits-update")
    written = sorted(p.name for p in baselines.glob("*.json"))
    assert written == [f"{model_type}--fp32.json"], recorded.outlines[-5:]
    gated = pytester.runpytest("-p", "no:cacheprovider", *flags, "-rs")
    for result in (recorded, gated):
        outcomes = result.parseoutcomes()
        assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.outlines[-20:]
        assert outcomes.get("passed", 0) >= 3  # copy loss and both kappa invariants compare on a random model
