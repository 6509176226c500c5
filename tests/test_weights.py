"""Per-head weights are right: they reproduce the model's own forward, for every family and build."""

from __future__ import annotations

import pytest
import torch

from pytest_circuits.model.builds import load_build
from pytest_circuits.model.families import attention_module, family_of, get_module, layer_modules
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.weights import StreamedWeights, extract_weights
from pytest_circuits.testing import make_tiny_model

from .conftest import FAMILIES


def _capture_attention(model, layer, input_ids):
    """The attention module's input (already normed), output, and pattern of one eager forward."""
    captured = {}
    attn = attention_module(model, layer)

    def before(module, args, kwargs):
        captured["x"] = kwargs.get("hidden_states", args[0] if args else None)

    def after(module, args, kwargs, output):
        captured["y"] = output[0]

    handles = [
        attn.register_forward_pre_hook(before, with_kwargs=True),
        attn.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            out = model(input_ids, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    return captured["x"].float(), captured["y"].float(), out.attentions[layer].float()


def _sum_over_heads(weights, layer, x, pattern, int8_threshold=None):
    """``sum_h A_h (x W_V[g(h)] + b_V) W_O[h] + b_O`` from the extracted raw weights.

    ``int8_threshold``: the projections are LLM.int8(); ``x`` and the concatenated head outputs
    ``z`` go through bitsandbytes' own quantizer first (`_bnb_int8_input`)."""
    lw = weights.layers[layer]
    geo = weights.geometry
    if int8_threshold is not None:
        x = _bnb_int8_input(x, int8_threshold)
    values = torch.einsum("btd,hde->bhte", x, weights.W_V_per_query_head(layer))
    if lw.b_V is not None:
        values = values + lw.b_V.repeat_interleave(geo.group_size, dim=0)[None, :, None, :]
    z = torch.einsum("bhts,bhse->bhte", pattern, values)
    if int8_threshold is not None:
        batch, heads, tokens, d_head = z.shape
        concatenated = _bnb_int8_input(z.transpose(1, 2).reshape(batch, tokens, heads * d_head), int8_threshold)
        z = concatenated.reshape(batch, tokens, heads, d_head).transpose(1, 2)
    out = torch.einsum("bhte,hed->btd", z, lw.W_O)
    return out if lw.b_O is None else out + lw.b_O


def _bnb_int8_input(x, threshold):
    """What an LLM.int8() layer multiplies its weight by, from bitsandbytes' ``int8_vectorwise_quant``
    (independent of `llm_int8`): codes times ``SCA / 127``, the outlier columns as they are."""
    import bitsandbytes.functional as bnbf

    rows = x.reshape(-1, x.shape[-1])
    codes, scales, columns = bnbf.int8_vectorwise_quant(rows.half(), threshold=threshold)
    out = codes.float() * scales[:, None] / 127
    if columns is not None and columns.numel():
        out[:, columns] = rows[:, columns]
    return out.reshape(x.shape)


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_sum_to_attention_output(family):
    model = make_tiny_model(family, seed=3)
    weights = extract_weights(model, fold=False)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for layer in range(weights.geometry.n_layers):
        x, y, pattern = _capture_attention(model, layer, ids)
        torch.testing.assert_close(_sum_over_heads(weights, layer, x, pattern), y, atol=1e-4, rtol=0)


@pytest.mark.parametrize("recipe", ["bnb-nf4", "bnb-fp4", "rtn-int4", "bnb-int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_heads_sum_to_attention_output(tiny_folder, family, recipe):
    """Dequantized weights reproduce the quantized layer's own output, within the tolerance of the
    dtype the layer really computes in (`selfcheck.tolerance_for`): float32 for RTN and for 4-bit
    layers on CPUs without AVX512-BF16, bfloat16 for 4-bit layers on CPUs with it (bitsandbytes
    casts the input there), and float16's for int8, whose activation quantization this sum
    applies with bitsandbytes' own quantizer."""
    from pytest_circuits.model.selfcheck import tolerance_for

    build = load_build(resolve_model(tiny_folder(family)), recipe, "cpu")
    weights = extract_weights(build.model, fold=False)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    x, y, pattern = _capture_attention(build.model, 1, ids)
    out_proj = get_module(attention_module(build.model, 1), family_of(build.model).out_proj)
    threshold = out_proj.state.threshold if recipe == "bnb-int8" else None
    error = _relative_error(_sum_over_heads(weights, 1, x, pattern, threshold).double(), y.double())
    assert error <= tolerance_for(build.model, torch.float32), error


def test_4bit_tolerance_follows_the_dtype_bitsandbytes_computes_in(tiny_folder, monkeypatch):
    """On a CPU with AVX512-BF16 bitsandbytes runs 4-bit matmuls in bfloat16: the tolerance must be
    bfloat16's there and float32's elsewhere, whichever CPU runs this test."""
    import bitsandbytes.functional as bnbf

    from pytest_circuits.model.selfcheck import TOLERANCES, tolerance_for

    build = load_build(resolve_model(tiny_folder("llama")), "bnb-nf4", "cpu")
    for has_bf16, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(bnbf, "has_avx512bf16", lambda value=has_bf16: value)
        assert tolerance_for(build.model, torch.float32) == TOLERANCES[dtype]


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_cpu_packed_4bit_weight_reads_what_the_matmul_uses(quant_type, nested):
    """bitsandbytes repacks a 4-bit weight at its first eval forward on AVX512-BF16 CPUs (codes
    re-laid per 32-row block, absmax in bfloat16). Packed here explicitly, so every CPU runs it:
    the read equals ``code[q] * bf16(absmax)`` from the unpacked weight (an independent route
    through ``dequantize_4bit``), and leaves the module untouched."""
    import copy

    bnb = pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf

    from pytest_circuits.model.dense import dense_weight

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(128, 96, bias=False, quant_type=quant_type, compute_dtype=torch.float32)
    layer.weight = bnb.nn.Params4bit(
        torch.randn(96, 128), requires_grad=False, quant_type=quant_type, compress_statistics=nested
    )
    layer = layer.to("cpu").eval()
    state = copy.deepcopy(layer.weight.quant_state)
    if state.nested:  # double quantization: the absmax values are themselves blockwise-quantized
        state.absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
        state.nested = False
    state.absmax = state.absmax.to(torch.bfloat16).float()
    expected = bnbf.dequantize_4bit(layer.weight.data, state).float()

    packed, packed_state = bnbf._convert_weight_packed_for_cpu(
        layer.weight.data.clone(), copy.deepcopy(layer.weight.quant_state)
    )
    layer.weight.data, layer.weight.quant_state = packed.clone(), packed_state
    assert packed_state.packing_format_for_cpu
    torch.testing.assert_close(dense_weight(layer), expected, atol=0, rtol=0)
    assert torch.equal(layer.weight.data, packed) and layer.weight.quant_state.packing_format_for_cpu


def _relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "recipe, max_rel",
    [
        ("bnb-int8", 0.02),
        ("rtn-int8", 0.02),
        ("bnb-nf4", 0.15),
        ("bnb-fp4", 0.25),
        ("rtn-int4", 0.25),
        ("bf16", 0.01),
        ("fp16", 0.002),
    ],
)
def test_dequantized_weights_near_float32(tiny_folder, recipe, max_rel):
    """Each recipe's weights are within its expected error of float32, and really changed."""
    source = resolve_model(tiny_folder("gpt2"))
    exact = extract_weights(load_build(source, "fp32", "cpu").model, fold=False)
    build = load_build(source, recipe, "cpu")
    approx = extract_weights(build.model, fold=False)
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        a = torch.stack([getattr(lw, name) for lw in approx.layers])
        b = torch.stack([getattr(lw, name) for lw in exact.layers])
        error = _relative_error(a, b)
        assert 0 < error < max_rel, f"{recipe} {name}: relative error {error:.4f}"


@pytest.mark.parametrize("bits", [8, 4])
def test_rtn_error_within_half_step(tiny_folder, bits):
    """Round-to-nearest moves no weight more than half a quantization step of its output channel."""
    source = resolve_model(tiny_folder("llama"))
    exact = load_build(source, "fp32", "cpu").model
    rounded = load_build(source, f"rtn-int{bits}", "cpu").model
    for (name, w), (_, q) in zip(exact.named_parameters(), rounded.named_parameters()):
        if ".layers." in name and name.endswith("proj.weight"):
            step = w.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1)
            assert ((w - q).abs() <= step / 2 + 1e-7).all(), name
            levels = (q / step).round()
            torch.testing.assert_close(q, levels * step, rtol=0, atol=1e-6)


def test_grouped_query_heads_read_their_group():
    """Perturbing key/value group g changes exactly the query heads h with h // group_size == g."""
    model = make_tiny_model("llama", seed=5, num_attention_heads=4, num_key_value_heads=2)
    geo = extract_weights(model).geometry
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids, output_attentions=True).attentions[0][0]
        k_proj = get_module(layer_modules(model)[0], "self_attn.k_proj")
        group = 1
        rows = slice(group * geo.d_head, (group + 1) * geo.d_head)
        k_proj.weight[rows] += torch.randn_like(k_proj.weight[rows])
        after = model(ids, output_attentions=True).attentions[0][0]
    changed = [(after[h] - before[h]).abs().max().item() > 1e-4 for h in range(geo.n_heads)]
    assert changed == [geo.kv_group(h) == group for h in range(geo.n_heads)]


def _norm_then_project(norm, x, W):
    return norm(x) @ W


@pytest.mark.parametrize("family", FAMILIES)
def test_folded_weights_reproduce_norm_then_project(family):
    """``norm(x) W = (x W_folded) / scale(x) + b W`` for the pre-attention and final norms."""
    model = make_tiny_model(family, seed=7)
    raw = extract_weights(model, fold=False)
    folded = extract_weights(model, fold=True)
    fam = family_of(model)
    x = torch.randn(5, raw.geometry.d_model, generator=torch.Generator().manual_seed(3)) * 3 + 1
    norm = get_module(layer_modules(model)[0], fam.attn_norm)
    final = get_module(model, fam.final_norm)
    for module, W_raw, W_fold in (
        (norm, raw.layers[0].W_V[0], folded.layers[0].W_V[0]),
        (norm, raw.layers[0].W_Q[1], folded.layers[0].W_Q[1]),
        (final, raw.W_U, folded.W_U),
    ):
        eps = getattr(module, "eps", None) or module.variance_epsilon
        if fam.norm_kind == "layernorm":
            scale = (x.var(dim=-1, unbiased=False, keepdim=True) + eps).sqrt()
            shift = module.bias.detach() @ W_raw
        else:
            scale = (x.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt()
            shift = 0
        with torch.no_grad():
            expected = _norm_then_project(module, x, W_raw)
        torch.testing.assert_close((x @ W_fold) / scale + shift, expected, atol=1e-4, rtol=1e-4)


def test_embeddings_and_unembedding_shapes():
    model = make_tiny_model("gpt2")
    weights = extract_weights(model)
    geo = weights.geometry
    assert weights.W_E.shape == (geo.vocab, geo.d_model)
    assert weights.W_U.shape == (geo.d_model, geo.vocab)
    assert weights.W_OV(1, 2).shape == (geo.d_model, geo.d_model)
    assert weights.W_QK(1, 2).shape == (geo.d_model, geo.d_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_weights_read_what_extract_weights_holds(family):
    """One layer at a time and the vocabulary in blocks: each read equals the same slice of the
    all-at-once read, bit for bit (W_V, W_O per layer; W_E over any block size); the folded W_U
    to float32 rounding (its fold is a matmul, whose kernel rounds by the block's width)."""
    model = make_tiny_model(family, seed=3)
    whole = extract_weights(model, fold=True)
    streamed = StreamedWeights.of(model, fold=True)
    assert streamed.n_layers == whole.n_layers and streamed.family == whole.family
    for layer in range(whole.n_layers):
        read = streamed.layer(layer)
        assert read.W_Q is None and read.W_K is None  # rung 1 reads no QK
        assert torch.equal(read.W_V, whole.layers[layer].W_V)
        assert torch.equal(read.W_O, whole.layers[layer].W_O)
    for rows in (None, 1, 7, whole.geometry.vocab + 5):
        blocks = list(streamed.vocab_blocks(rows))
        torch.testing.assert_close(torch.cat([u for u, _ in blocks], dim=1), whole.W_U, rtol=1e-6, atol=1e-7)
        assert torch.equal(torch.cat([e for _, e in blocks]), whole.W_E), rows
    unfolded = list(StreamedWeights.of(model, fold=False).vocab_blocks(7))
    assert torch.equal(torch.cat([u for u, _ in unfolded], dim=1), extract_weights(model, fold=False).W_U)


def test_streamed_weights_dequantize_per_block(tiny_folder):
    """A quantized build read in blocks and per layer equals its all-at-once dequantized read."""
    build = load_build(resolve_model(tiny_folder("llama")), "rtn-int4", "cpu")
    whole = extract_weights(build.model)
    streamed = StreamedWeights.of(build.model)
    assert torch.equal(streamed.layer(1).W_V, whole.layers[1].W_V)
    blocks = list(streamed.vocab_blocks(5))
    torch.testing.assert_close(torch.cat([u for u, _ in blocks], dim=1), whole.W_U, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_half_builds_load_at_their_dtype_with_the_bits_of_a_cast(tiny_folder, recipe):
    """A bf16/fp16 build loads straight at its dtype (no float32 copy of the model) and holds
    exactly the parameters and buffers that loading float32 and casting gave."""
    from pytest_circuits.model.builds import from_pretrained, get_recipe, torch_dtype

    source = resolve_model(tiny_folder("llama"))
    dtype = torch_dtype(get_recipe(recipe))
    cast = from_pretrained(source.folder, "x", "cpu", dtype=torch.float32).to(dtype=dtype)
    built = load_build(source, recipe, "cpu").model
    for theirs, ours in (
        (cast.named_parameters(), built.named_parameters()),
        (cast.named_buffers(), built.named_buffers()),
    ):
        a, b = dict(theirs), dict(ours)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
