"""Rung 1, weights: the OV copying score kappa, its rotation null, and the assertion helpers."""

from __future__ import annotations

import io
import json

import numpy as np
import pandas as pd
import pytest
import torch

from pytest_circuits.assertions import (
    MAX_ROWS,
    FrameError,
    assert_copying_heads_preserved,
    assert_kappa_close,
    assert_kappa_distribution_unshifted,
)
from pytest_circuits.errors import CircuitsError
from pytest_circuits.model.builds import load_build
from pytest_circuits.model.families import get_module, layer_modules, out_proj_module
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.weights import StreamedWeights, extract_weights
from pytest_circuits.rungs.kappa import (
    COLUMNS,
    EXTRA_COLUMNS,
    SpectrumError,
    analytic_floor,
    kappa_scores,
    ov_spectrum,
    ov_spectrum_of_model,
    reduced_ov,
    shared_unembed_embed,
    unembed_embed_pair,
    without_attrs,
)
from pytest_circuits.rungs.kappa_null import benjamini_hochberg, haar_rotations, symmetric_t
from pytest_circuits.rungs.plain_loops import plain_kappa, plain_ov_spectrum, plain_reduced_ov
from pytest_circuits.testing import make_tiny_model, requires_embedded_model, requires_smollm2

from .conftest import LEGACY_BASELINE

NUMERIC = [
    "kappa",
    "kappa_trace",
    "kappa_null_mean",
    "kappa_null_sd",
    "kappa_z",
    "kappa_p",
    "kappa_trace_null_mean",
    "kappa_trace_null_sd",
    "kappa_trace_z",
    "kappa_trace_p",
    "kappa_uncentred",
    "kappa_trace_uncentred",
]


def _write_W_O(model, layer: int, head: int, W_O: torch.Tensor) -> None:
    """Write head ``LlHh``'s ``W_O`` (``d_head x d_model``, row-vector convention) into the model."""
    proj = out_proj_module(model, layer)
    d_head = W_O.shape[0]
    rows = slice(head * d_head, (head + 1) * d_head)
    with torch.no_grad():
        if type(proj).__name__ == "Conv1D":  # weight (in, out): rows of head h are its W_O
            proj.weight[rows, :] = W_O.to(proj.weight.dtype)
        else:  # nn.Linear weight (out, in)
            proj.weight[:, rows] = W_O.T.to(proj.weight.dtype)


def _constructed_head(family: str, sign: float, layer: int = 1, head: int = 2, noise: float = 0.05):
    """A tiny model whose head ``LlHh`` has ``M_h ~ sign * c * I``: ``W_O = sign c pinv((W_U W_E) W_V)`` plus noise."""
    model = make_tiny_model(family, seed=3)
    w = extract_weights(model)
    read = shared_unembed_embed(w) @ w.W_V_of(layer, head).double()  # (d_model, d_head)
    W_O = sign * torch.linalg.pinv(read)
    W_O = W_O / W_O.norm() * w.layers[layer].W_O[head].double().norm()  # keep the model's scale
    gen = torch.Generator().manual_seed(7)
    W_O = W_O + noise * W_O.std() * torch.randn(W_O.shape, generator=gen, dtype=torch.float64)
    _write_W_O(model, layer, head, W_O.float())
    return model, f"L{layer}H{head}"


# ---------------------------------------------------------------- the scores


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_constructed_copying_head_is_flagged(family):
    model, label = _constructed_head(family, +1.0)
    df = ov_spectrum_of_model(model).set_index("head")
    assert df.loc[label, "kappa"] > 0.9
    assert df.loc[label, "kappa_trace"] > 0.9
    assert df.loc[label, "copying"] and not df.loc[label, "suppression"]
    assert df["kappa_z"].idxmax() == label


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_constructed_suppression_head_is_flagged(family):
    model, label = _constructed_head(family, -1.0)
    df = ov_spectrum_of_model(model).set_index("head")
    assert df.loc[label, "kappa"] < -0.9
    assert df.loc[label, "kappa_trace"] < -0.9
    assert df.loc[label, "suppression"] and not df.loc[label, "copying"]


def test_columns_attrs_and_summary():
    w = extract_weights(make_tiny_model("llama", seed=0))
    df = ov_spectrum(w, n_rotations=300, seed=4)
    geo = w.geometry
    assert tuple(df.columns[: len(COLUMNS)]) == COLUMNS
    assert tuple(df.columns[len(COLUMNS) :]) == EXTRA_COLUMNS
    assert len(df) == geo.n_layers * geo.n_heads
    assert df["head"].tolist()[:3] == ["L0H0", "L0H1", "L0H2"]
    assert df.attrs["eigenvalues"].shape == (geo.n_layers, geo.n_heads, geo.d_head)
    assert np.iscomplexobj(df.attrs["eigenvalues"])
    assert df.attrs["null_kappa"].shape == (geo.n_layers, geo.n_heads, 300)
    summary = df.attrs["summary"]
    assert summary["analytic_floor"] == pytest.approx(1 / np.sqrt(2 * geo.d_head)) == analytic_floor(geo.d_head)
    assert summary["median_null_sd"] == pytest.approx(df["kappa_null_sd"].median())
    assert (summary["q"], summary["n_rotations"], summary["seed"], summary["folded"]) == (0.05, 300, 4, True)
    assert df["kv_group"].tolist() == [geo.kv_group(h) for h in df["head_index"]]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_batched_equals_per_head_reference(family):
    """The batched scan with float64 products is the per-head reference to float64 round-off
    (the float32 products, the default, are pinned against it below)."""
    w = extract_weights(make_tiny_model(family, seed=1))
    fast = ov_spectrum(w, n_rotations=64, seed=2, product_dtype=torch.float64)
    slow = plain_ov_spectrum(w, n_rotations=64, seed=2)
    np.testing.assert_allclose(fast[NUMERIC].to_numpy(), slow[NUMERIC].to_numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fast["kappa_q"], slow["kappa_q"], atol=1e-6)
    assert fast[["copying", "suppression"]].equals(slow[["copying", "suppression"]])
    M = reduced_ov(w, dtype=torch.float64)
    for layer, head in [(0, 0), (1, 3)]:
        np.testing.assert_allclose(M[layer, head].numpy(), plain_reduced_ov(w, layer, head), rtol=1e-9, atol=1e-12)
        k, t = plain_kappa(M[layer, head].numpy())
        assert fast.set_index("head").loc[f"L{layer}H{head}", "kappa"] == pytest.approx(k, abs=1e-6)
        assert fast.set_index("head").loc[f"L{layer}H{head}", "kappa_trace"] == pytest.approx(t, abs=1e-6)
        gain = np.abs(np.linalg.eigvals(plain_reduced_ov(w, layer, head))).sum()  # sum_i |lambda_i|
        assert fast.set_index("head").loc[f"L{layer}H{head}", "ov_gain"] == pytest.approx(gain, rel=1e-9)


def test_scores_on_known_spectra():
    assert plain_kappa(np.eye(4)) == (1.0, 1.0)
    assert plain_kappa(-2 * np.eye(4)) == (-1.0, -1.0)
    rotation = np.array([[0.0, -1.0], [1.0, 0.0]])  # eigenvalues +-i: no copying, no suppression
    assert plain_kappa(rotation) == pytest.approx((0.0, 0.0), abs=1e-12)
    rank_one = np.zeros((4, 4))
    rank_one[0, 0] = 3.0  # three zero eigenvalues count f = 0: kappa = 1/4, trace-weighted 1
    assert plain_kappa(rank_one) == pytest.approx((0.25, 1.0))
    _, k, t = kappa_scores(torch.zeros(2, 3, 3))
    assert k.tolist() == [0.0, 0.0] and t.tolist() == [0.0, 0.0]


def test_negating_W_O_flips_both_scores():
    w = extract_weights(make_tiny_model("gpt2", seed=2))
    before = ov_spectrum(w, n_rotations=64).set_index("head")
    w.layers[1].W_O[3].neg_()
    after = ov_spectrum(w, n_rotations=64).set_index("head")
    for column in ("kappa", "kappa_trace"):
        assert after.loc["L1H3", column] == pytest.approx(-before.loc["L1H3", column], abs=1e-9)
    # the null's eigenvalues are float32 (default): M R and -M R round differently, ~1e-6 relative
    assert after.loc["L1H3", "kappa_z"] == pytest.approx(-before.loc["L1H3", "kappa_z"], rel=1e-5)
    assert after.loc["L1H3", "kappa_p"] == pytest.approx(before.loc["L1H3", "kappa_p"], rel=1e-4)
    untouched = before.index != "L1H3"
    pd.testing.assert_frame_equal(before.loc[untouched, NUMERIC], after.loc[untouched, NUMERIC])


def test_grouped_query_heads_read_their_group_W_V():
    model = make_tiny_model("llama", seed=0)  # 4 query heads, 2 key/value groups
    w = extract_weights(model)
    assert w.geometry.group_size == 2
    before = ov_spectrum(w, n_rotations=64)
    v_proj = get_module(layer_modules(model)[1], "self_attn.v_proj")
    d_head = w.geometry.d_head
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        v_proj.weight[d_head : 2 * d_head] = torch.randn(d_head, v_proj.weight.shape[1], generator=gen) * 0.05
    w2 = extract_weights(model)
    after = ov_spectrum(w2, n_rotations=64)
    changed = ~np.isclose(before["kappa"], after["kappa"], rtol=0, atol=1e-12)
    assert after.loc[changed, "head"].tolist() == ["L1H2", "L1H3"]
    for head in range(4):  # each query head's M_h uses its group's W_V
        M = reduced_ov(w2, dtype=torch.float64)[1, head].numpy()
        np.testing.assert_allclose(M, plain_reduced_ov(w2, 1, head), rtol=1e-9)


def test_same_seed_same_result_other_seed_other_null():
    w = extract_weights(make_tiny_model("gpt_neox", seed=0))
    a, b = ov_spectrum(w, seed=11), ov_spectrum(w, seed=11, n_workers=1)
    pd.testing.assert_frame_equal(a, b)
    np.testing.assert_array_equal(a.attrs["null_kappa"], b.attrs["null_kappa"])
    c = ov_spectrum(w, seed=12)
    pd.testing.assert_series_equal(a["kappa"], c["kappa"])
    assert not np.array_equal(a.attrs["null_kappa"], c.attrs["null_kappa"])


def test_float32_null_matches_float64_null():
    w = extract_weights(make_tiny_model("llama", seed=0))
    a, b = ov_spectrum(w, n_rotations=64), ov_spectrum(w, n_rotations=64, null_dtype=torch.float32)
    pd.testing.assert_series_equal(a["kappa"], b["kappa"])
    for column in ("kappa_null_mean", "kappa_null_sd", "kappa_trace_null_sd"):
        np.testing.assert_allclose(a[column], b[column], atol=1e-4)
    assert b.attrs["summary"]["null_dtype"] == "float32"


def test_haar_rotations_are_orthogonal_and_unbiased():
    R = haar_rotations(2000, 3, torch.Generator().manual_seed(0))
    np.testing.assert_allclose((R.transpose(1, 2) @ R).numpy(), np.broadcast_to(np.eye(3), (2000, 3, 3)), atol=1e-12)
    assert abs(R.mean(0)).max() < 0.05  # Haar: E[R] = 0 (a sign-unfixed QR is biased towards +diag)
    dets = torch.linalg.det(R)
    assert 0.4 < (dets > 0).double().mean() < 0.6  # both components of O(d)


# ---------------------------------------------------------------- the centred unembedding


def _kappa_by_hand(model, layer: int, head: int, centre: bool) -> tuple[float, float]:
    """kappa and kappa_trace of one head from the vocab x vocab map ``W_E W_OV W_U (I - 11^T/V)``,
    built from the model's modules (Llama layout: RMSNorm, separate projections, untied lm_head)."""
    block = model.model.layers[layer]
    attn, cfg = block.self_attn, model.config
    d_head = cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    g = block.input_layernorm.weight.double()
    W_V = (attn.v_proj.weight.double().T * g[:, None])[:, (head // group) * d_head : (head // group + 1) * d_head]
    W_O = attn.o_proj.weight.double().T[head * d_head : (head + 1) * d_head]
    W_E = model.model.embed_tokens.weight.double()
    W_U = model.model.norm.weight.double()[:, None] * model.lm_head.weight.double().T
    V = W_U.shape[1]
    if centre:
        W_U = W_U @ (torch.eye(V, dtype=torch.float64) - torch.full((V, V), 1.0 / V, dtype=torch.float64))
    full = (W_E @ W_V @ W_O @ W_U).detach().numpy()  # what attending token t adds to each logit
    lam = np.linalg.eigvals(full)
    lam = lam[np.argsort(-np.abs(lam))][:d_head]  # rank <= d_head: the rest are round-off
    kappa = np.mean([z.real / abs(z) if abs(z) > 1e-6 * abs(lam[0]) else 0.0 for z in lam])
    return float(kappa), float(lam.real.sum() / np.abs(lam).sum())


def test_centred_kappa_equals_the_vocabulary_map_by_hand():
    model = make_tiny_model("llama", seed=5)
    df = ov_spectrum_of_model(model, n_rotations=8).set_index("head")
    assert df.attrs["summary"]["unembedding"] == "centred"
    moved = 0.0
    for layer, head in [(0, 0), (0, 3), (1, 1)]:
        row = df.loc[f"L{layer}H{head}"]
        k, t = _kappa_by_hand(model, layer, head, centre=True)
        assert (row["kappa"], row["kappa_trace"]) == (pytest.approx(k, abs=1e-6), pytest.approx(t, abs=1e-6))
        k_u, t_u = _kappa_by_hand(model, layer, head, centre=False)
        assert row["kappa_uncentred"] == pytest.approx(k_u, abs=1e-6)
        assert row["kappa_trace_uncentred"] == pytest.approx(t_u, abs=1e-6)
        moved = max(moved, abs(k - k_u), abs(t - t_u))
    assert moved > 1e-3  # the two read different maps


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_constant_logit_shift_leaves_centred_kappa_alone(family):
    """``W_U + c 1^T`` (the same vector ``c`` added to every token's column: a logit shift common
    to every token, per residual direction) changes no softmax, nor the centred kappa."""
    model = make_tiny_model(family, seed=2)
    before = ov_spectrum_of_model(model, n_rotations=16)
    head = model.get_output_embeddings()
    if head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr():  # tied (GPT-2): untie
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    gen = torch.Generator().manual_seed(0)
    c = 3.0 * head.weight.std() * torch.randn(head.weight.shape[1], generator=gen)
    with torch.no_grad():
        head.weight += c  # lm_head weight is (vocab, d_model): every token's row gets c
    after = ov_spectrum_of_model(model, n_rotations=16)
    centred = [c for c in NUMERIC if "uncentred" not in c]
    np.testing.assert_allclose(after[centred].to_numpy(), before[centred].to_numpy(), rtol=1e-5, atol=1e-5)
    assert after[["copying", "suppression"]].equals(before[["copying", "suppression"]])
    assert np.abs(after["kappa_uncentred"] - before["kappa_uncentred"]).max() > 0.05


def test_uncentred_unembedding_is_the_stored_one():
    """``unembedding="uncentred"`` scores the stored W_U: the centred scan's ``*_uncentred`` figures (its
    centred ``M_h`` plus the rank-one shift) to float64 round-off (float64 products; float32 ones are
    pinned against float64 in test_float32_products_match_the_float64_reference)."""
    w = extract_weights(make_tiny_model("llama", seed=0))
    f64 = torch.float64
    centred = ov_spectrum(w, n_rotations=16, product_dtype=f64)
    raw = ov_spectrum(w, n_rotations=16, unembedding="uncentred", product_dtype=f64)
    assert raw.attrs["summary"]["unembedding"] == "uncentred"
    np.testing.assert_allclose(raw["kappa"], centred["kappa_uncentred"], atol=1e-12)
    np.testing.assert_allclose(raw["kappa_trace"], centred["kappa_trace_uncentred"], atol=1e-12)
    np.testing.assert_allclose(raw["kappa"], raw["kappa_uncentred"], atol=0)
    with pytest.raises(SpectrumError, match="unknown unembedding 'mean'; use one of: centred, uncentred"):
        ov_spectrum(w, unembedding="mean")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blocked_unembed_embed_equals_the_direct_product(family):
    """``W_U W_E`` summed over vocabulary blocks (any size, the last one short) equals the one
    product of the whole matrices, and the centred one equals ``W_U (I - 11^T / V) W_E`` formed
    explicitly (float64, numpy): blocking changes the rounding, nothing else."""
    weights = extract_weights(make_tiny_model(family, seed=4))
    W_U, W_E = weights.W_U.double().numpy(), weights.W_E.double().numpy()
    V = W_E.shape[0]
    expected = {"uncentred": W_U @ W_E, "centred": W_U @ (np.eye(V) - np.ones((V, V)) / V) @ W_E}
    direct = unembed_embed_pair(weights, dtype=torch.float64)
    for rows in (1, 7, V - 1, V, V + 3):
        blocked = unembed_embed_pair(weights, rows=rows, dtype=torch.float64)
        for name in expected:
            np.testing.assert_allclose(blocked[name].numpy(), expected[name], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(blocked[name].numpy(), direct[name].numpy(), rtol=1e-12, atol=1e-13)
    streamed = unembed_embed_pair(StreamedWeights.of(make_tiny_model(family, seed=4)), rows=5, dtype=torch.float64)
    float32 = unembed_embed_pair(weights, rows=7)  # the default: each block multiplied in float32
    for name in expected:  # its folded W_U blocks differ from the whole matrix's by float32 rounding
        scale = np.abs(expected[name]).max()
        np.testing.assert_allclose(streamed[name].numpy(), expected[name], rtol=0, atol=1e-6 * scale)
        np.testing.assert_allclose(float32[name].numpy(), expected[name], rtol=0, atol=1e-6 * scale)
        assert float32[name].dtype == torch.float64


FLOAT32_TOL = 1e-4  # |kappa, kappa_trace (float32 products) - float64|, per head (docs/definitions.md)
SCORES = ["kappa", "kappa_trace", "kappa_uncentred", "kappa_trace_uncentred"]
FLAG_COLUMNS = ["copying", "suppression", "copying_trace", "suppression_trace"]


def _assert_float32_matches(fast: pd.DataFrame, slow: pd.DataFrame) -> float:
    """The float32-product frame's scores within `FLOAT32_TOL` of the float64 one's, its flags the same; the largest difference."""
    assert fast.attrs["summary"]["product_dtype"] == "float32"
    np.testing.assert_allclose(fast[SCORES].to_numpy(), slow[SCORES].to_numpy(), rtol=0, atol=FLOAT32_TOL)
    assert fast[FLAG_COLUMNS].equals(slow[FLAG_COLUMNS])
    return float(np.abs(fast[SCORES].to_numpy() - slow[SCORES].to_numpy()).max())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_float32_products_match_the_float64_reference(family):
    """Rung 1's default float32 products (``W_U W_E`` per vocabulary block, every ``M_h``; the uncentred
    ``M_h`` as the centred one's rank-one shift) against the plain float64 per-head loop."""
    w = extract_weights(make_tiny_model(family, seed=1))
    fast, slow = ov_spectrum(w, n_rotations=64, seed=2), plain_ov_spectrum(w, n_rotations=64, seed=2)
    _assert_float32_matches(fast, slow)
    M = reduced_ov(w)  # float32 products, float64 result
    assert M.dtype == torch.float64
    for layer, head in [(0, 0), (1, 3)]:
        expected = plain_reduced_ov(w, layer, head)
        np.testing.assert_allclose(M[layer, head].numpy(), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@requires_embedded_model()
def test_embedded_model_float32_rung1_matches_the_float64_reference():
    """The embedded model's kappa and kappa_trace with float32 products: the plain float64 loop's to 1e-4."""
    model = load_build(resolve_model("tiny-induction"), "fp32").model
    w = extract_weights(model)
    fast = ov_spectrum_of_model(model)  # the session's way: streamed, float32 products
    slow = plain_ov_spectrum(w)
    assert _assert_float32_matches(fast, slow) > 0  # float32 did run: the figures are not float64's bit for bit


def test_streamed_spectrum_equals_the_all_at_once_spectrum():
    """Rung 1 read one layer at a time (the session's way) gives the figures of the all-at-once read."""
    model = make_tiny_model("llama", seed=6)
    whole = ov_spectrum(extract_weights(model), n_rotations=16)
    streamed = ov_spectrum(StreamedWeights.of(model), n_rotations=16)
    np.testing.assert_allclose(streamed[NUMERIC].to_numpy(), whole[NUMERIC].to_numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(streamed.attrs["eigenvalues"], whole.attrs["eigenvalues"], rtol=1e-9, atol=1e-12)
    assert streamed[["copying", "suppression"]].equals(whole[["copying", "suppression"]])
    assert streamed.attrs["summary"] == whole.attrs["summary"]


# ---------------------------------------------------------------- the gate measures a build the baseline's way


def test_kappa_method_of_a_record():
    from pytest_circuits.record.kappa_method import LEGACY, KappaMethod, of_record

    shipped = json.loads(LEGACY_BASELINE.read_text())
    assert "unembedding" not in shipped["rung1"]  # recorded before the centred unembedding
    assert of_record(shipped) == LEGACY == KappaMethod("uncentred", 256, "normal", "float64", min_effect=0.0)
    assert of_record({"rung1": {**shipped["rung1"], **KappaMethod().as_dict()}}) == KappaMethod()
    assert of_record({}) == LEGACY


@pytest.fixture(scope="module")
def tiny_induction_session():
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    return Run(CircuitsSettings(model="tiny-induction", device="cpu"))


@requires_embedded_model()
def test_gate_measures_the_candidate_as_its_baseline_was_measured(tiny_induction_session):
    """Against a shipped (older) baseline the candidate is uncentred with the 256-draw normal null,
    and reproduces the baseline; a new record is centred with the 32-draw t null."""
    from pytest_circuits.record.schema import Record
    from pytest_circuits.run.flow import candidate_record

    session = tiny_induction_session
    baseline = json.loads(LEGACY_BASELINE.read_text())
    old_way = candidate_record(session.records, "fp32", baseline, knockout=False).data
    assert {k: old_way["rung1"][k] for k in ("unembedding", "n_rotations", "p_method", "null_dtype")} == {
        "unembedding": "uncentred",
        "n_rotations": 256,
        "p_method": "normal",
        "null_dtype": "float64",
    }
    for b, a in zip(baseline["heads"], old_way["heads"]):
        assert a["kappa"] == pytest.approx(b["kappa"], abs=2e-5)
        # the baseline's M_h was multiplied in float64, the candidate's in float32: kappa moves by up to
        # 7e-6 here and kappa_z by that over the null's sd (0.056); the same 2e-5 of kappa, in z units
        assert a["kappa_z"] == pytest.approx(b["kappa_z"], rel=1e-4, abs=2e-5 / b["kappa_null_sd"])
        assert a["kappa_uncentred"] == a["kappa"]
    typed = session.records.record("fp32", knockout=False)
    new = typed.data
    assert isinstance(typed, Record)
    assert (new["rung1"]["unembedding"], new["rung1"]["n_rotations"], new["rung1"]["p_method"]) == ("centred", 32, "t")
    assert candidate_record(session.records, "fp32", typed, knockout=False) is typed  # new against new: one scan
    kappa_new = np.array([h["kappa"] for h in new["heads"]])
    kappa_old = np.array([h["kappa"] for h in baseline["heads"]])
    np.testing.assert_allclose([h["kappa_uncentred"] for h in new["heads"]], kappa_old, atol=2e-5)
    assert np.abs(kappa_new - kappa_old).max() > 1e-3


def test_gate_build_asks_each_baseline_for_its_own_method():
    """The plugin's gate (`gate_build`) measures the build once per way of measuring: the older
    reference baseline's (uncentred, 256 normal draws) and the newer own baseline's (centred, t)."""
    from types import SimpleNamespace

    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record.kappa_method import LEGACY, KappaMethod
    from pytest_circuits.record.schema import Record
    from pytest_circuits.run.flow import gate_build

    old = json.loads(LEGACY_BASELINE.read_text())
    new = {**old, "rung1": {**old["rung1"], **KappaMethod().as_dict()}}
    asked = []

    class Parts:  # the gate's typed inputs: the record source and the baselines
        settings = SimpleNamespace(reference="fp32")

        def load(self, build_name):
            return old if build_name == "fp32" else new

        def record(self, build_name, knockout=True, method=None, key_heads=False):
            asked.append(method)
            return Record.of(old if method == LEGACY else new)  # a `RecordSource` gives typed records

        def stand_in(self):
            return {"model": new["model"], "probe": new["probe"]}

    outcome = gate_build(Parts(), Parts(), "bf16", "copying_heads", Tolerances(), {})
    assert asked == [LEGACY, KappaMethod()]
    assert [r.status for r in outcome.results] == ["passed", "passed"]


@requires_embedded_model()
def test_records_of_two_kappa_methods_pair_only_like_figures(tiny_induction_session):
    """``circuits diff`` of an older baseline and a new record: kappa and kappa_trace pair with the
    new record's uncentred twins; what the null decides (z, flags) is not compared, and the
    invariant that needs it says why (a failure), never reading the method as a change."""
    from pytest_circuits.gate.invariants import evaluate
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record.schema import Record
    from pytest_circuits.show import diff_rows

    old = json.loads(LEGACY_BASELINE.read_text())
    new = tiny_induction_session.records.record("fp32", knockout=False)
    old = Record.of(old)
    copying = evaluate("copying_heads", old, new, Tolerances(), "fp32", "fp32 baseline")
    assert copying.status == "passed" and copying.compared > 3
    shift = evaluate("kappa_distribution", old, new, Tolerances(), "fp32", "fp32 baseline")
    assert shift.status == "failed" and shift.compared == 0
    assert shift.message.startswith(
        "the fp32 baseline measured kappa with uncentred W_U, 256-draw float64 normal null, min effect 0, "
        "fp32 with centred W_U, 32-draw float32 t null, min effect 0.05: kappa_z, kappa_trace_z of two methods "
        "are not compared"
    )
    assert [r for r in diff_rows(old, new) if r[1].startswith("kappa") or r[1] in ("copying", "suppression")] == []
    moved = {h.head for h, b in zip(new.heads, old.heads) if abs(h.kappa_trace - b.kappa_trace) > 0.5}
    assert moved >= {"L1H1", "L1H2", "L1H3"}  # what a naive diff would have called a change
    for name in ("copying_heads", "kappa_distribution"):
        assert evaluate(name, new, new, Tolerances(), "fp32", "fp32 baseline").status == "passed"


def test_folded_differs_from_raw_on_layernorm_models():
    model = make_tiny_model("gpt2", seed=0)
    folded, raw = ov_spectrum_of_model(model, n_rotations=32), ov_spectrum_of_model(model, fold=False, n_rotations=32)
    assert folded.attrs["summary"]["folded"] and not raw.attrs["summary"]["folded"]
    assert not np.allclose(folded["kappa"], raw["kappa"])


def test_positive_scale_of_embedding_leaves_kappa():
    """``W_E x 4`` (a power of two: exact in float32, so every float32 product and ``M_h`` scale exactly)
    leaves every figure. The null's eigenvalues in float64 here: float32 ``eigvals`` of exactly ``4 M R``
    is not always exactly 4x that of ``M R`` (1.8e-8 apart on one draw of this model), so the float32 null
    is scale-invariant to its rounding only."""
    w = extract_weights(make_tiny_model("llama", seed=0))
    a = ov_spectrum(w, n_rotations=32, null_dtype=torch.float64)
    w.W_E.mul_(4.0)
    b = ov_spectrum(w, n_rotations=32, null_dtype=torch.float64)
    np.testing.assert_allclose(a[NUMERIC].to_numpy(), b[NUMERIC].to_numpy(), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(b.attrs["eigenvalues"], 4 * a.attrs["eigenvalues"], rtol=1e-12, atol=0)


def test_user_errors_are_one_line():
    w = extract_weights(make_tiny_model("gpt2", seed=0))
    bad = (
        {"n_rotations": 1},
        {"q": 0.0},
        {"q": 1.5},
        {"p_method": "bootstrap"},
        {"seed": -1},
        {"null_dtype": torch.float16},
        {"n_workers": 0},
        {"product_dtype": torch.bfloat16},
    )
    for kwargs in bad:
        with pytest.raises(SpectrumError) as info:
            ov_spectrum(w, **kwargs)
        assert "\n" not in str(info.value)
    with pytest.raises(CircuitsError, match="extract_weights"):
        ov_spectrum(make_tiny_model("gpt2"))


def test_empirical_p_has_its_floor():
    model, label = _constructed_head("gpt2", +1.0)
    df = ov_spectrum_of_model(model, n_rotations=99, p_method="empirical").set_index("head")
    assert df.loc[label, "kappa_p"] == pytest.approx(1 / 100)
    assert df.attrs["summary"]["p_method"] == "empirical"


def test_benjamini_hochberg():
    p = np.array([0.01, 0.04, 0.03, 0.2])
    np.testing.assert_allclose(benjamini_hochberg(p), [0.04, 0.16 / 3, 0.16 / 3, 0.2])  # m p_(i) / i, then running min
    from scipy.stats import false_discovery_control

    rng = np.random.default_rng(0)
    p = rng.uniform(size=200) ** 3
    np.testing.assert_allclose(benjamini_hochberg(p), false_discovery_control(p), rtol=1e-12)


# ---------------------------------------------------------------- calibration on random models

CALIBRATION_MODELS = [
    ("gpt2", dict(n_layer=3, n_head=8, n_embd=128)),
    ("gpt_neox", dict(num_hidden_layers=3, num_attention_heads=8, hidden_size=128)),
    ("llama", dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, hidden_size=128)),
    ("gpt2", dict(n_layer=2, n_head=4, n_embd=128)),  # d_head 32
]


def _pooled_random_heads(seeds, models=CALIBRATION_MODELS):
    frames = [
        ov_spectrum_of_model(make_tiny_model(family, seed=seed, **shape), seed=seed)
        for family, shape in models
        for seed in seeds
    ]
    return pd.concat([without_attrs(f) for f in frames], ignore_index=True)


def test_random_models_flag_at_most_q():
    """Random init: W_V is rotation-invariant, so the rotation null is exact; BH flags <= q of the heads."""
    pooled = _pooled_random_heads(seeds=(0, 1), models=CALIBRATION_MODELS[:3])
    assert len(pooled) == 2 * 3 * 24
    flagged = (pooled["copying"] | pooled["suppression"]).mean()
    assert flagged <= 0.05
    assert (pooled["kappa_p"] < 0.05).mean() <= 0.10  # uncorrected: about 0.05
    assert (pooled["kappa_trace_p"] < 0.05).mean() <= 0.10


@pytest.mark.slow
def test_random_model_p_values_are_uniform():
    from scipy.stats import kstest

    pooled = _pooled_random_heads(seeds=range(2, 8))
    assert (pooled["copying"] | pooled["suppression"]).mean() <= 0.05
    for column in ("kappa_p", "kappa_trace_p"):
        assert kstest(pooled[column], "uniform").pvalue > 0.001, column
        assert (pooled[column] < 0.05).mean() <= 0.08, column


# ---------------------------------------------------------------- quantized builds


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("recipe, kappa_median_tol, trace_tol", [("bnb-int8", 0.02, 0.02), ("bnb-nf4", 0.1, 0.06)])
def test_quantized_build_is_dequantized_first(tiny_folder, family, recipe, kappa_median_tol, trace_tol):
    pytest.importorskip("bitsandbytes")
    source = resolve_model(str(tiny_folder(family)))
    reference = ov_spectrum_of_model(load_build(source, "fp32"), n_rotations=64)
    build = load_build(source, recipe)
    assert any("Linear8bitLt" in type(m).__name__ or "Linear4bit" in type(m).__name__ for m in build.model.modules())
    candidate = ov_spectrum_of_model(build, n_rotations=64)
    assert (candidate["kappa"] - reference["kappa"]).abs().median() <= kappa_median_tol
    assert (candidate["kappa"] - reference["kappa"]).abs().max() <= 0.2
    assert (candidate["kappa_trace"] - reference["kappa_trace"]).abs().max() <= trace_tol


@requires_embedded_model()
def test_embedded_model_int8_keeps_its_copying_heads():
    pytest.importorskip("bitsandbytes")
    source = resolve_model("tiny-induction")
    reference = ov_spectrum_of_model(load_build(source, "fp32"))
    assert reference["copying"].any(), "the embedded model should have a copying head at fp32"
    candidate = ov_spectrum_of_model(load_build(source, "bnb-int8"))
    assert_copying_heads_preserved(reference, candidate, kappa_tol=0.1)
    assert_kappa_close(reference, candidate, tol=0.1, column="kappa_trace")


@pytest.mark.real
@pytest.mark.slow
@requires_smollm2()
def test_smollm2_batched_equals_reference_on_some_heads():
    w = extract_weights(load_build(resolve_model("smollm2-135m"), "fp32").model)
    assert (w.geometry.n_layers, w.geometry.n_heads, w.geometry.d_head) == (30, 9, 64)
    heads = [(0, 0), (15, 4), (29, 8)]
    slow = plain_ov_spectrum(w, n_rotations=16, heads=heads)
    M = reduced_ov(w, dtype=torch.float64)
    for i, (layer, head) in enumerate(heads):
        k, t = plain_kappa(M[layer, head].numpy())
        assert k == pytest.approx(slow.loc[i, "kappa"], abs=1e-6)
        assert t == pytest.approx(slow.loc[i, "kappa_trace"], abs=1e-6)
        _, kb, tb = kappa_scores(M[layer, head])
        assert float(kb) == pytest.approx(k, abs=1e-6) and float(tb) == pytest.approx(t, abs=1e-6)


@pytest.mark.real
@pytest.mark.slow
@requires_smollm2()
def test_smollm2_float32_rung1_matches_float64_on_every_head():
    """SmolLM2-135M's 270 heads: kappa and kappa_trace (centred and uncentred) with float32 products within
    1e-4 of float64 products (largest measured: 1.4e-5, kappa_uncentred), the same flags."""
    weights = StreamedWeights.of(load_build(resolve_model("smollm2-135m"), "fp32").model)
    fast, slow = ov_spectrum(weights), ov_spectrum(weights, product_dtype=torch.float64)
    assert len(fast) == 270 and slow.attrs["summary"]["product_dtype"] == "float64"
    _assert_float32_matches(fast, slow)


@pytest.mark.real
@requires_smollm2()
def test_smollm2_rung1_finds_copying_heads_and_its_induction_head_copies():
    """Rung 1 on the real model: many heads copy (kappa near +1), the flags respect the null,
    and the strongest induction head (found by the repeat probe, not by kappa) copies."""
    from pytest_circuits.rungs.probe import run_repeat_probe
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    build = load_build(resolve_model("smollm2-135m"), "fp32")
    spectrum = ov_spectrum_of_model(build, n_rotations=64).set_index("head")
    assert len(spectrum) == 270
    assert (spectrum["kappa"] > 0.9).sum() >= 5, spectrum["kappa"].describe()
    flagged = spectrum[spectrum["copying"]]
    assert (flagged["kappa"] > 0).all() and (flagged["kappa_q"] <= 0.05).all()
    probe = run_repeat_probe(build, RepeatSettings(seed=0, n=2, L=64))
    induction = probe.heads.set_index("head")["prefix_matching"].idxmax()
    assert probe.heads.set_index("head").loc[induction, "prefix_matching"] > 0.5
    assert spectrum.loc[induction, "kappa_trace"] > 0.1, spectrum.loc[induction]
    assert spectrum.loc[induction, "copying"], spectrum.loc[induction]


# ---------------------------------------------------------------- assertion helpers (pure, synthetic frames)


def _frame(kappa, copying=None, suppression=None, n_heads=4) -> pd.DataFrame:
    kappa = np.asarray(kappa, dtype=float)
    labels = [f"L{i // n_heads}H{i % n_heads}" for i in range(len(kappa))]
    return pd.DataFrame(
        {
            "head": labels,
            "kappa": kappa,
            "kappa_trace": kappa,
            "copying": kappa > 0.5 if copying is None else copying,
            "suppression": kappa < -0.5 if suppression is None else suppression,
        }
    )


def test_assert_kappa_close_names_heads_and_caps_rows():
    kappa = np.linspace(-0.5, 0.5, 40)
    kappa[5] = 0.91
    ref = _frame(kappa)
    assert_kappa_close(ref, ref.assign(kappa=ref.kappa + 0.05), tol=0.1)
    moved = kappa.copy()
    moved[:30] += 0.3
    moved[5] = -0.88
    cand = ref.assign(kappa=moved)
    with pytest.raises(AssertionError) as info:
        assert_kappa_close(ref, cand, tol=0.1)
    message = str(info.value)
    assert message.startswith("30 of 40 heads moved their kappa by more than 0.1:")
    assert "  L1H1 kappa +0.910 -> -0.880 (tolerance 0.1)" in message  # the gate's row format
    assert message.splitlines()[1].lstrip().startswith("L1H1")  # largest change first
    assert len(message.splitlines()) == 1 + MAX_ROWS + 1 and message.endswith("... and 10 more")


def test_assert_copying_heads_preserved():
    ref = _frame([0.95, 0.9, 0.1, -0.05, 0.8, -0.9, 0.3, 0.0])
    drifted = ref.assign(kappa=ref.kappa - 0.05, copying=[True, False, False, False, True, False, False, False])
    assert_copying_heads_preserved(ref, drifted)  # L0H1 lost its flag but moved only 0.05
    fallen = ref.copy()
    fallen.loc[1, ["kappa", "copying"]] = [-0.88, False]
    lost = r"1 of 3 copying heads lost[\s\S]*L0H1 kappa \+0\.900 -> -0\.880 \(tolerance 0\.15\) copying -> not copying"
    with pytest.raises(AssertionError, match=lost):
        assert_copying_heads_preserved(ref, fallen, min_spearman=None)
    assert_copying_heads_preserved(ref, fallen, min_survival=0.6, min_spearman=None)
    flipped = ref.copy()
    flipped.loc[5, ["kappa", "suppression"]] = [0.2, False]
    assert_copying_heads_preserved(ref, flipped, min_spearman=None)
    with pytest.raises(AssertionError, match="L1H1 .*suppression -> not suppression"):
        assert_copying_heads_preserved(ref, flipped, include_suppression=True, min_spearman=None)
    shuffled = ref.assign(kappa=ref.kappa.to_numpy()[::-1])
    shuffled["copying"] = ref["copying"]
    with pytest.raises(AssertionError, match="Spearman rank correlation of kappa across 8 heads"):
        assert_copying_heads_preserved(ref, shuffled, kappa_tol=2.0)
    # a copying head that writes almost nothing (0.5% of the largest OV gain) is not watched
    gains = ref.assign(ov_gain=[1.0, 0.005, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert_copying_heads_preserved(gains, fallen.assign(ov_gain=gains.ov_gain), min_spearman=None)
    with pytest.raises(AssertionError, match="L0H1"):
        assert_copying_heads_preserved(gains, fallen.assign(ov_gain=gains.ov_gain), min_spearman=None, min_ov_gain=0)


def test_assert_kappa_distribution_unshifted():
    rng = np.random.default_rng(1)
    ref = _frame(np.tanh(rng.normal(0.2, 0.6, 270)), n_heads=9)
    noisy = ref.assign(kappa=ref.kappa + rng.normal(0, 0.03, 270))
    assert_kappa_distribution_unshifted(ref, noisy)
    other_model = _frame(np.tanh(rng.normal(0.2, 0.6, 240)), n_heads=8)  # a base-model swap: other heads
    assert_kappa_distribution_unshifted(ref, other_model)
    collapsed = ref.assign(kappa=ref.kappa * 0.3)
    with pytest.raises(AssertionError) as info:
        assert_kappa_distribution_unshifted(ref, collapsed)
    assert "distribution of kappa shifted" in str(info.value) and "q0.75" in str(info.value)


def test_assertions_check_their_input():
    ref = _frame([0.9, 0.1, -0.9, 0.0])
    with pytest.raises(FrameError, match="lacks column"):
        assert_kappa_close(ref.drop(columns="kappa"), ref)
    with pytest.raises(FrameError, match="not the same heads"):
        assert_kappa_close(ref, _frame([0.9, 0.1, -0.9, 0.0, 0.2]))
    with pytest.raises(CircuitsError):
        assert_copying_heads_preserved(ref, "not a frame")


def test_assertions_on_real_frames_and_json_round_trip():
    w = extract_weights(make_tiny_model("llama", seed=0))
    ref = ov_spectrum(w, n_rotations=32)
    rebuilt = pd.read_json(io.StringIO(without_attrs(ref).to_json(orient="records")), orient="records")
    for cand in (ov_spectrum(w, n_rotations=32, seed=9), rebuilt):  # attrs with arrays merge fine
        assert_kappa_close(ref, cand, tol=1e-9)
        assert_copying_heads_preserved(ref, cand)
        assert_kappa_distribution_unshifted(ref, cand)


# ---------------------------------------------------------------- the cheap symmetric-t null


def test_symmetric_t_is_exact_for_a_normal_null_with_few_draws():
    """With the mean known (0) and the spread estimated from n draws, t = k/s is Student-t with
    n degrees of freedom: p is uniform even at n = 8, where 2 Phi(-|t|) would flag far too many."""
    from scipy.stats import kstest, norm

    rng = np.random.default_rng(0)
    heads, n = 20000, 8
    sigma = rng.uniform(0.02, 0.2, heads)
    null = rng.normal(0.0, sigma[:, None], (heads, n))
    observed = rng.normal(0.0, sigma)
    mean, sd, z, p = symmetric_t(observed, null)
    assert (mean == 0).all()
    np.testing.assert_allclose(sd, np.sqrt((null**2).mean(axis=1)))
    assert kstest(p, "uniform").pvalue > 0.001
    assert abs((p < 0.05).mean() - 0.05) < 0.006
    naive = 2 * norm.sf(np.abs(observed / sd))
    assert (naive < 0.05).mean() > 0.07  # the normal p ignores the estimated spread


def test_symmetric_t_z_is_unbiased_for_kappa_over_sigma():
    rng = np.random.default_rng(1)
    heads, n, sigma = 40000, 32, 0.05
    null = rng.normal(0.0, sigma, (heads, n))
    observed = np.full(heads, 3 * sigma)
    z = symmetric_t(observed, null)[2]
    assert z.mean() == pytest.approx(3.0, abs=0.01)  # k/s alone is 2.4% high at n = 32
    assert (observed / np.sqrt((null**2).mean(axis=1))).mean() == pytest.approx(3.0 * 1.024, abs=0.01)


def test_cheap_null_spread_agrees_with_the_256_draw_null():
    """32 draws estimate the same null spread as 256 (the old default), within sampling error."""
    w = extract_weights(
        make_tiny_model(
            "llama", seed=5, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, hidden_size=128
        )
    )
    cheap = ov_spectrum(w)
    full = ov_spectrum(w, n_rotations=256, p_method="normal", null_dtype=torch.float64)
    assert cheap.attrs["summary"]["n_rotations"] == 32 and cheap.attrs["summary"]["p_method"] == "t"
    ratio = cheap["kappa_null_sd"] / full["kappa_null_sd"]
    assert abs(np.log(ratio)).max() < 4 / np.sqrt(2 * 32)  # 4 standard errors of a 32-draw spread
    assert abs(full["kappa_null_mean"] / full["kappa_null_sd"]).max() < 4 / np.sqrt(256)  # the null's mean is 0


def test_the_assertions_default_to_the_gate_tolerances():
    """One set of defaults: a move the gate's copying_heads spares (kappa 0.15) passes here too."""
    import inspect

    from pytest_circuits.gate.tolerances import Tolerances

    gate = Tolerances()
    ref = _frame([0.95, 0.9, 0.1, -0.05, 0.8, -0.9, 0.3, 0.0])
    assert_kappa_close(ref, ref.assign(kappa=ref.kappa + 0.9 * gate.kappa))
    with pytest.raises(AssertionError, match=f"by more than {gate.kappa:g}"):
        assert_kappa_close(ref, ref.assign(kappa=ref.kappa + 1.1 * gate.kappa))
    preserved = inspect.signature(assert_copying_heads_preserved).parameters
    assert preserved["kappa_tol"].default == gate.kappa and preserved["min_spearman"].default == gate.rank
    assert preserved["min_ov_gain"].default == gate.min_ov_gain
