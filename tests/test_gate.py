"""The gate's invariants on hand-built records, the sabotage helpers, and the default tolerances."""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from pytest_circuits.gate import invariants as gate
from pytest_circuits.gate.invariants import InvariantResult, Row, format_rows, gate_all, key_heads
from pytest_circuits.gate.invariants import evaluate as check
from pytest_circuits.gate.stats import spearman
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.run import flow
from pytest_circuits.testing import (
    add_weight_noise,
    flatten_head_qk,
    has_embedded_model,
    make_tiny_model,
    negate_head_ov,
)

from .scan_records import complete

TOL = Tolerances()


def record(n_layers=2, n_heads=4, seed=0) -> dict:
    """A plausible record: L0H1 previous-token, L1H2 induction and copying, L1H3 suppression."""
    rng = np.random.default_rng(seed)
    heads = []
    for l in range(n_layers):
        for h in range(n_heads):
            name = f"L{l}H{h}"
            kappa = float(rng.uniform(-0.2, 0.2))
            heads.append(
                {
                    "head": name,
                    "layer": l,
                    "head_index": h,
                    "kappa": kappa,
                    "kappa_trace": kappa,
                    "kappa_z": kappa * 5,
                    "kappa_trace_z": kappa * 5,
                    "copying": False,
                    "suppression": False,
                    "prefix_matching": 0.02,
                    "previous_token": 0.05,
                    "duplicate_token": 0.02,
                    "knockout_delta": 0.01,
                    "ov_gain": 1.0,
                }
            )
    by = {r["head"]: r for r in heads}
    by["L1H2"].update(
        kappa=0.91,
        kappa_trace=0.95,
        kappa_z=8.0,
        kappa_trace_z=9.0,
        copying=True,
        prefix_matching=0.85,
        knockout_delta=3.0,
    )
    by["L1H3"].update(
        kappa=-0.6, kappa_trace=-0.7, kappa_z=-5.0, kappa_trace_z=-6.0, suppression=True, knockout_delta=-0.2
    )
    by["L0H1"].update(previous_token=0.9, knockout_delta=1.5, kappa_z=3.0)
    return complete({"copy_loss": 0.4, "first_copy_loss": 6.0, "copy_gain": 5.6, "heads": heads})


def head(rec, name):
    return next(h for h in rec["heads"] if h["head"] == name)


def test_identical_records_pass_every_invariant():
    results = gate_all(record(), record(), TOL, "bnb-nf4", "fp32 baseline")
    # every per-build invariant but the opt-in ones (rung 3), whose figures neither record holds
    assert [r.invariant for r in results] == [
        n for n, inv in gate.REGISTRY.items() if not inv.across_models and not inv.opt_in
    ]
    assert all(r.passed and isinstance(r, InvariantResult) for r in results)
    assert all(r.as_dict()["moved"] == [] for r in results)


def test_flipped_copying_head_fails_and_names_it():
    after = record()
    head(after, "L1H2").update(kappa=-0.88, kappa_trace=-0.9)
    result = check("copying_heads", record(), after, TOL, "bnb-nf4", "fp32 baseline", fix="FIX LINE")
    assert not result.passed
    assert re.search(r"L1H2\s+kappa\s+\+0\.910 -> -0\.880 \(tolerance 0\.15\) copying", result.message)
    assert result.message.endswith("FIX LINE")
    moved = {(m["head"], m["metric"]) for m in result.moved}
    assert {("L1H2", "kappa"), ("L1H2", "kappa_trace")} <= moved
    assert all(m["tolerance"] == TOL.kappa for m in result.moved if m["head"] == "L1H2")


def test_small_kappa_moves_pass_and_tolerance_is_two_sided():
    after = record()
    head(after, "L1H3").update(kappa=-0.6 + 0.14, kappa_trace=-0.7 - 0.14)
    assert check("copying_heads", record(), after, TOL, "b", "a").passed
    head(after, "L1H3").update(kappa=-0.6 + 0.16)
    assert not check("copying_heads", record(), after, TOL, "b", "a").passed


def test_unflagged_heads_gate_on_kappa_trace_only():
    after = record()
    head(after, "L0H0").update(kappa=head(after, "L0H0")["kappa"] + 0.5)  # noisy unweighted kappa
    assert check("copying_heads", record(), after, TOL, "b", "a").passed
    head(after, "L0H0").update(kappa_trace=head(after, "L0H0")["kappa_trace"] + 0.5)
    result = check("copying_heads", record(), after, TOL, "b", "a")
    assert not result.passed and result.moved[0]["head"] == "L0H0"


def with_gains(rec, gains: dict) -> dict:
    """The record with an ``ov_gain`` per head: 1.0 unless ``gains`` says otherwise."""
    rec = copy.deepcopy(rec)
    for row in rec["heads"]:
        row["ov_gain"] = gains.get(row["head"], 1.0)
    return rec


def test_heads_with_negligible_ov_gain_are_not_compared():
    """A head that writes almost nothing has eigenvalue directions set by noise: its kappa may
    swing under quantization without the circuit changing. Below min_ov_gain x the largest
    gain it is left out, and the message says how many were; at the threshold it counts."""
    before = with_gains(record(), {"L1H3": 0.005})  # the suppression head, 0.5% of the largest
    after = copy.deepcopy(before)
    head(after, "L1H3").update(kappa=0.3, kappa_trace=0.4)
    result = check("copying_heads", before, after, TOL, "b", "a")
    assert result.passed and "1 heads with OV gain < 0.01 x the largest not compared" in result.message
    assert gate.negligible_heads(before, TOL.min_ov_gain) == {"L1H3"}
    at_threshold = with_gains(record(), {"L1H3": 0.01})
    moved = copy.deepcopy(at_threshold)
    head(moved, "L1H3").update(kappa=0.3, kappa_trace=0.4)
    assert not check("copying_heads", at_threshold, moved, TOL, "b", "a").passed
    assert check("copying_heads", before, after, TOL.updated({"min_ov_gain": 0}), "b", "a").passed is False


def test_ov_gain_falls_back_to_the_stored_eigenvalues():
    """Records written before the ov_gain column gate the same way, from their eigenvalues."""
    rec = without_gains(record())
    rec["eigenvalues"] = {row["head"]: [[3.0, 4.0], [-1.0, 0.0]] for row in rec["heads"]}  # |3+4i| + |-1| = 6
    rec["eigenvalues"]["L1H3"] = [[0.03, 0.0], [0.0, 0.0]]
    rec["model"]["geometry"]["d_head"] = 2
    gains = gate.ov_gains(rec)
    assert gains["L0H0"] == pytest.approx(6.0) and gains["L1H3"] == pytest.approx(0.03)
    assert gate.negligible_heads(rec, TOL.min_ov_gain) == {"L1H3"}
    bare = without_gains(record())
    assert gate.ov_gains(bare) == {} and gate.negligible_heads(bare, TOL.min_ov_gain) == set()


def without_gains(rec: dict) -> dict:
    """The record as written before the ``ov_gain`` column (and without eigenvalues unless added)."""
    for row in rec["heads"]:
        row.pop("ov_gain", None)
    return rec


def test_ov_gain_holds_the_key_heads_sizes_and_only_theirs():
    """Key heads are the induction, previous-token and knockout heads (L1H2 and L0H1 here); each
    keeps ``|ln(gain' / gain)| <= ov_gain``. A non-key head may change freely; a negligible key head is
    left out and said; a key head without a gain in the build is an error; a baseline without key
    heads has nothing to check; OV gains of two unembeddings are not compared."""
    before = with_gains(record(), {"L1H2": 4.0, "L0H1": 2.0, "L1H3": 1.0})
    assert gate.sampled_key_heads(before, TOL) == ["L0H1", "L1H2"]  # L1H3's delta is negative: not key
    weaker = with_gains(record(), {"L1H2": 4.0 * 0.85, "L0H1": 2.0, "L1H3": 0.5, "L0H0": 9.0})
    result = check("ov_gain", before, weaker, TOL, "b", "a")
    assert not result.passed and result.compared == 2 and [m["head"] for m in result.moved] == ["L1H2"]
    assert result.moved[0]["change"] == pytest.approx(math.log(0.85)) and "(x0.850)" in result.message
    slight = with_gains(record(), {"L1H2": 4.0 * 0.95, "L0H1": 2.0 * 1.05, "L1H3": 1.0, "L0H0": 9.0})
    assert check("ov_gain", before, slight, TOL, "b", "a").passed

    tiny_key = with_gains(record(), {"L1H2": 4.0, "L0H1": 0.01})  # under 0.01 x the largest (4.0)
    result = check("ov_gain", tiny_key, with_gains(record(), {"L1H2": 4.0, "L0H1": 0.5}), TOL, "b", "a")
    assert result.passed and result.compared == 1
    assert "1 key heads with OV gain < 0.01 x the largest not compared" in result.message

    unmeasured = with_gains(record(), {"L1H2": 4.0, "L0H1": 2.0, "L1H3": 1.0})
    head(unmeasured, "L1H2")["ov_gain"] = None
    unmeasured["eigenvalues"] = {}
    result = check("ov_gain", before, unmeasured, TOL, "b", "a")
    assert not result.passed and "NOT MEASURED" in result.message

    no_circuit = with_gains(record(), {})
    for row in no_circuit["heads"]:
        row.update(prefix_matching=0.0, previous_token=0.0, knockout_delta=0.0)
    assert check("ov_gain", no_circuit, no_circuit, TOL, "b", "a").status == "skipped"

    other = copy.deepcopy(before)
    other["rung1"] = {"n_rotations": 64, "q": 0.05, "unembedding": "uncentred"}
    centred = {**copy.deepcopy(before), "rung1": {"n_rotations": 64, "q": 0.05, "unembedding": "centred"}}
    result = check("ov_gain", other, centred, TOL, "b", "a")
    assert not result.passed and result.compared == 0 and "uncentred W_U" in result.message


def test_spearman_matches_scipy():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=12), rng.normal(size=12)
    b[3] = b[4]  # a tie
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)


def test_rank_order_of_distinguishable_heads_is_gated():
    before = record()
    for name, z, k in (("L0H0", 3.0, 0.5), ("L0H2", 2.5, 0.4), ("L0H3", -2.5, -0.3)):
        head(before, name).update(kappa_z=z, kappa=k)
    after = copy.deepcopy(before)
    # reverse the order of the distinguishable heads' kappa, each move within the per-head tolerance
    ks = {"L1H2": 0.91, "L1H3": -0.6, "L0H1": head(before, "L0H1")["kappa"], "L0H0": 0.5, "L0H2": 0.4, "L0H3": -0.3}
    order = sorted(ks, key=ks.get)
    values = sorted(ks.values())
    for name, value in zip(order, values[::-1]):
        head(after, name)["kappa"] = value
    strict = Tolerances(kappa=10.0)
    result = check("copying_heads", before, after, strict, "b", "a")
    assert not result.passed and result.moved[-1]["metric"] == "rank corr"
    assert result.moved[-1]["after"] == pytest.approx(-1.0)
    assert check("copying_heads", before, after, Tolerances(kappa=10.0, rank=-1.0), "b", "a").passed


def test_kappa_distribution_shift():
    after = record()
    for h in after["heads"]:
        h["kappa_z"] += 0.9
    assert check("kappa_distribution", record(), after, TOL, "b", "a").passed
    for h in after["heads"]:
        h["kappa_z"] += 0.2
    result = check("kappa_distribution", record(), after, TOL, "b", "a")
    assert not result.passed
    expected = np.mean([h["kappa_z"] for h in record()["heads"]]) + 1.1
    assert result.moved[0]["after"] == pytest.approx(expected)


def test_kappa_shift_names_only_the_heads_that_drive_it():
    """One head moves 20 null sds, the others 0.05: the mean shift (2.5 of 8 heads) fails, and
    only the head that moved at least that far is named as driving it."""
    before, after = record(), record()
    for h in after["heads"]:
        h["kappa_z"] += 20.0 if h["head"] == "L1H2" else 0.05
    result = check("kappa_distribution", before, after, TOL, "b", "a")
    assert not result.passed
    assert [m["head"] for m in result.moved if m["note"] == "(drives the shift)"] == ["L1H2"]


@pytest.mark.parametrize("delta, passes", [(0.24, True), (-0.24, True), (0.3, False), (-0.3, False)])
def test_copy_loss_two_sided(delta, passes):
    after = record()
    after["copy_loss"] += delta
    after["copy_gain"] -= delta
    result = check("copy_loss", record(), after, TOL, "b", "a")
    assert result.passed is passes
    if not passes:
        assert {m["metric"] for m in result.moved} == {"copy_loss", "copy_gain"}


def test_key_heads_and_induction_check():
    before = record()
    assert key_heads(before, "prefix_matching", 3, 0.2) == ["L1H2"]
    assert key_heads(before, "knockout_delta", 2, 0.1) == ["L1H2", "L0H1"]
    after = record()
    head(after, "L0H1")["previous_token"] = 0.3
    result = check("induction_heads", before, after, TOL, "b", "a")
    assert not result.passed and result.moved[0]["head"] == "L0H1" and result.moved[0]["metric"] == "previous_token"
    flat = record()
    for h in flat["heads"]:
        h.update(prefix_matching=0.01, previous_token=0.01)
    skipped = check("induction_heads", flat, flat, TOL, "b", "a")
    assert skipped.skipped and not skipped.passed and "nothing to check" in skipped.message


def test_knockout_deltas_keep_their_size():
    after = record()
    head(after, "L1H2")["knockout_delta"] = 3.0 * (1 - (TOL.knockout - 0.01))
    assert check("knockout_deltas", record(), after, TOL, "b", "a").passed
    head(after, "L1H2")["knockout_delta"] = 3.0 * (1 - (TOL.knockout + 0.01))
    result = check("knockout_deltas", record(), after, TOL, "b", "a")
    assert not result.passed and result.moved[0]["tolerance"] == pytest.approx(TOL.knockout * 3.0)


def test_message_table_is_capped():
    rows = [Row(f"L0H{i}", "kappa", 0.5, -0.5, 0.1, True) for i in range(25)]
    text = format_rows(rows)
    assert text.count("\n") == 20 and text.endswith("... and 5 more")


def test_tolerance_overrides():
    assert TOL.updated({"kappa": "0.05", "top_k": 5}).kappa == 0.05
    with pytest.raises(ValueError, match="unknown tolerance"):
        TOL.updated({"kapa": 1})
    with pytest.raises(ValueError, match="must be a number"):
        TOL.updated({"kappa": "wide"})
    with pytest.raises(ValueError, match=">= 0"):
        TOL.updated({"copy_loss": -1})


# ---------------------------------------------------------------- sabotage helpers, checked independently


def reduced_ov_eigs(model, layer, head):
    """Eigenvalues of W_O W_U W_E W_V of one head, straight from the GPT-2 tensors (no folding)."""
    d = model.config.n_embd
    dh = d // model.config.n_head
    c_attn = model.transformer.h[layer].attn.c_attn.weight.detach().double()  # (d, 3d), row vectors
    W_V = c_attn[:, 2 * d + head * dh : 2 * d + (head + 1) * dh]
    W_O = model.transformer.h[layer].attn.c_proj.weight.detach().double()[head * dh : (head + 1) * dh]
    W_E = model.transformer.wte.weight.detach().double()
    M = W_O @ W_E.T @ W_E @ W_V
    return np.linalg.eigvals(M.numpy())


def test_negate_head_ov_flips_that_head_only():
    model = make_tiny_model("gpt2", seed=1)
    before = {(l, h): reduced_ov_eigs(model, l, h) for l in range(2) for h in range(4)}
    negate_head_ov(model, 1, 2)
    for (l, h), eig in before.items():
        after = reduced_ov_eigs(model, l, h)
        expected = -eig if (l, h) == (1, 2) else eig
        assert np.allclose(np.sort_complex(after), np.sort_complex(expected), atol=1e-8)


def attention(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, output_attentions=True).attentions


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama"])
def test_flatten_head_qk_makes_that_head_uniform(family):
    model = make_tiny_model(family, seed=2)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    before = attention(model, ids)
    flatten_head_qk(model, 0, 1)
    after = attention(model, ids)
    T = ids.shape[1]
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1).unsqueeze(1)
    assert torch.allclose(after[0][:, 1], uniform.expand(2, T, T), atol=1e-6)
    assert not torch.allclose(before[0][:, 1], uniform.expand(2, T, T), atol=1e-3)
    assert torch.allclose(after[0][:, 0], before[0][:, 0], atol=1e-6)  # other heads of the layer untouched


def test_add_weight_noise_has_the_asked_size():
    model = make_tiny_model("gpt2", seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    add_weight_noise(model, 1e-2, seed=0)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            rel = (p.detach() - before[name]).pow(2).mean().sqrt() / before[name].pow(2).mean().sqrt()
            assert 0.008 < float(rel) < 0.012, name
        else:
            assert torch.equal(p, before[name])


# ---------------------------------------------------------------- the defaults, on the embedded model

needs_embedded = pytest.mark.skipif(
    not has_embedded_model(), reason="embedded model missing: python scripts/train_tiny_induction.py"
)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The fp32 record of tiny-induction plus a maker of sabotaged copies' records."""
    from transformers import AutoModelForCausalLM

    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.repeat_settings import RepeatSettings
    from pytest_circuits.settings import CircuitsSettings

    probe = RepeatSettings(0, 8, 32)

    def session(model):
        return Run(CircuitsSettings(model=model, device="cpu", probe=probe))

    base = session("tiny-induction")
    reference = base.records.record("fp32")

    def edited(edit):
        model = AutoModelForCausalLM.from_pretrained(base.loaded.source.folder, dtype=torch.float32)
        edit(model)
        folder = tmp_path_factory.mktemp("edited")
        model.save_pretrained(folder, safe_serialization=True)
        return session(str(folder)).records.record("fp32")

    return reference, edited, base


def lh(label):
    layer, h = label[1:].split("H")
    return int(layer), int(h)


@needs_embedded
def test_benign_changes_pass_the_default_gate(embedded):
    reference, edited, base = embedded

    def bf16_round_trip(model):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())

    for name, record in (
        ("bf16 round trip", edited(bf16_round_trip)),
        ("noise 1e-3", edited(lambda m: add_weight_noise(m, 1e-3, seed=0))),
    ):
        broken = [r.message for r in gate_all(reference, record, TOL, name, "fp32 baseline") if not r.passed]
        assert not broken, f"{name}: {broken}"


@needs_embedded
def test_sabotage_fails_the_default_gate(embedded):
    reference, edited, _ = embedded
    induction = key_heads(reference, "prefix_matching", 1, 0.0)[0]
    previous = key_heads(reference, "previous_token", 1, 0.0)[0]
    assert induction.startswith("L1") and previous.startswith("L0")  # the model has its circuit
    negated = edited(lambda m: negate_head_ov(m, *lh(induction)))
    results = {r.invariant: r for r in gate_all(reference, negated, TOL, "negated", "fp32 baseline")}
    assert not results["copying_heads"].passed and induction in results["copying_heads"].message
    assert not results["copy_loss"].passed
    flattened = edited(lambda m: flatten_head_qk(m, *lh(previous)))
    results = {r.invariant: r for r in gate_all(reference, flattened, TOL, "flattened", "fp32 baseline")}
    assert not results["induction_heads"].passed and previous in results["induction_heads"].message
    assert not results["copy_loss"].passed


# ---------------------------------------------------------------- one build against its baselines (fake session)


class FakeSession:
    """What `gate.gate_build` needs: settings.reference, record(), load_baseline()."""

    def __init__(self, baselines: dict, candidate: dict, reference="fp32"):
        from types import SimpleNamespace

        self.settings = SimpleNamespace(reference=reference)
        self.saved, self.candidate = baselines, candidate
        self.records = self.baselines = self  # the record source and the baselines, both typed inputs of the gate

    def record(self, build_name, knockout=True, method=None, key_heads=False):
        from pytest_circuits.record.schema import Record

        return Record.of(self.candidate)  # a `RecordSource` gives typed records

    def stand_in(self):
        return {"model": dict(self.candidate.get("model") or {}), "probe": self.candidate.get("probe")}

    def load(self, build_name):
        from pytest_circuits.errors import BaselineMissing

        if build_name not in self.saved:
            raise BaselineMissing(
                f"baseline {build_name}.json does not exist; record it with: circuits record m --build {build_name}"
            )
        return self.saved[build_name]


def gate_build(session, *rest):
    """`run.flow.gate_build` of a session's typed parts."""
    return flow.gate_build(session.records, session.baselines, *rest)


def with_model(rec, fingerprint="sha256:aa", n_heads=4):
    """``rec`` of a model of ``n_heads`` heads a layer (the heads of ``record(n_heads=...)``)."""
    if n_heads != rec["model"]["geometry"]["n_heads"]:
        rec = record(n_heads=n_heads)
    rec["model"].update(
        fingerprint=fingerprint,
        geometry={"n_layers": 2, "n_heads": n_heads, "n_kv_heads": n_heads, "d_model": 8, "d_head": 2, "vocab": 16},
    )
    rec["probe"] = {"seed": 0, "n": 4, "L": 8}
    return rec


def test_gate_build_against_reference_and_own():
    fixes = {"own": "OWN FIX", "reference": "REF FIX"}
    cand = with_model(record())
    head(cand, "L1H2")["kappa_trace"] = -0.9
    both = FakeSession({"fp32": with_model(record()), "bnb-nf4": with_model(record())}, cand)
    outcome = gate_build(both, "bnb-nf4", "copying_heads", TOL, fixes)
    assert [r.against for r in outcome.results] == ["fp32 baseline", "own baseline"]
    assert not outcome.passed and outcome.message().count("L1H2") == 2
    assert "REF FIX" in outcome.message() and outcome.message().endswith("OWN FIX")


def test_gate_build_missing_own_is_skipped_missing_reference_fails():
    cand = with_model(record())
    only_ref = FakeSession({"fp32": with_model(record())}, cand)
    outcome = gate_build(only_ref, "bnb-nf4", "copy_loss", TOL, {})
    assert outcome.passed and [r.against for r in outcome.results] == ["fp32 baseline"]
    no_ref = FakeSession({"bnb-nf4": with_model(record())}, cand)
    outcome = gate_build(no_ref, "bnb-nf4", "copy_loss", TOL, {})
    assert not outcome.passed and "circuits record m --build fp32" in outcome.problems[0]
    outcome = gate_build(FakeSession({}, cand), "fp32", "copy_loss", TOL, {})  # the reference build itself
    assert not outcome.passed and "does not exist" in outcome.message()


def test_gate_build_skips_other_geometry_and_notes_other_weights():
    cand = with_model(record(), fingerprint="sha256:bb")
    outcome = gate_build(FakeSession({"fp32": with_model(record())}, cand), "fp32", "copy_loss", TOL, {})
    assert outcome.passed and len(outcome.notes) == 1 and "weights differ" in outcome.notes[0]
    other = with_model(record(), n_heads=6)  # another geometry: another model
    outcome = gate_build(FakeSession({"fp32": other}, cand), "fp32", "copy_loss", TOL, {})
    assert outcome.skipped and not outcome.passed and not outcome.problems
    assert "copy_loss (builds of one model) is not compared across models (geometry n_heads 6 vs 4" in outcome.message()
    assert "per-head invariants were not compared" in outcome.notes[0]


def test_gate_build_unknown_invariant():
    from pytest_circuits.errors import CircuitsError

    with pytest.raises(CircuitsError, match="unknown invariant 'copying'"):
        gate_build(FakeSession({}, record()), "fp32", "copying", TOL, {})


# ---------------------------------------------------------------- a user's own invariant


class FirstCopyLoss(gate.Invariant):
    """A user's invariant: the first-copy loss (how unpredictable fresh tokens are) stays put."""

    name = "first_copy_loss"
    reads = ("copy_loss",)
    held = "first-copy loss of {build} holds against the {against}"
    moved = "first-copy loss of {build} moved against the {against}"

    def compare(self, before, after, tol):
        return gate.Comparison(
            [gate.within("model", "first_copy_loss", before.first_copy_loss, after.first_copy_loss, tol.copy_loss)]
        )


@pytest.fixture
def registered():
    gate.register(FirstCopyLoss)
    yield FirstCopyLoss.name
    del gate.REGISTRY[FirstCopyLoss.name]


def test_a_registered_invariant_joins_the_gate(registered):
    results = {r.invariant: r for r in gate_all(record(), record(), TOL, "b", "fp32 baseline")}
    assert registered in results and results[registered].passed and results[registered].compared == 1
    after = record()
    after["first_copy_loss"] = 9.0
    result = check(registered, record(), after, TOL, "b", "fp32 baseline", fix="FIX")
    assert not result.passed and "first_copy_loss +6.000 -> +9.000 (tolerance 0.25)" in result.message
    assert result.message.startswith(
        "first_copy_loss: model first_copy_loss +6.000 -> +9.000 (tolerance 0.25) (first-copy loss of b moved against"
    )
    assert result.message.endswith("FIX")


def test_an_invariant_that_compares_nothing_never_passes():
    class Empty(gate.Invariant):
        name = "empty"

        def compare(self, before, after, tol):
            return gate.Comparison(nothing="nothing here")

    result = check(Empty(), record(), record(), TOL, "b", "a")
    assert result.status == "failed" and result.message == "nothing here" and result.compared == 0
    passed, line = gate.verdict([result])
    assert not passed and "gate failed: empty" in line
    skipped = check("induction_heads", *(2 * [_flat()]), TOL, "b", "a")
    passed, line = gate.verdict([skipped])
    assert not passed and "gate compared nothing" in line


def _flat():
    flat = record()
    for h in flat["heads"]:
        h.update(prefix_matching=0.01, previous_token=0.01)
    return flat


def test_an_undefined_rank_correlation_breaks_the_invariant():
    before, after = record(), record()
    for h in after["heads"]:
        h["kappa"] = 0.3  # constant: Spearman is undefined
    result = check("copying_heads", before, after, Tolerances(kappa=10.0), "b", "a")
    assert not result.passed and "rank corr" in result.message and "undefined" in result.message


def test_knockouts_of_other_settings_are_not_compared():
    before, after = record(), record()
    before["knockout"], after["knockout"] = (
        {"mode": "mean", "seed": 1, "n": 4, "L": 8},
        {"mode": "zero", "seed": 1, "n": 4, "L": 8},
    )
    result = check("knockout_deltas", before, after, TOL, "b", "fp32 baseline")
    assert result.status == "failed" and "other settings (mode mean vs zero)" in result.message


def test_one_comparison_skipped_and_one_passed_is_a_pass():
    cand = with_model(record())
    own = with_model(_flat())
    outcome = gate_build(
        FakeSession({"fp32": with_model(record()), "bnb-nf4": own}, cand), "bnb-nf4", "induction_heads", TOL, {}
    )
    assert [r.status for r in outcome.results] == ["passed", "skipped"] and outcome.passed


def test_a_failure_leads_with_the_invariant_and_its_worst_row_notes_after():
    """pytest's short summary shows a failure's first line: the broken invariant and its worst row,
    not ``note: the weights differ``; the note names which fingerprint is the baseline's, which the build's."""
    cand = with_model(record(), fingerprint="sha256:" + "b" * 64)
    head(cand, "L1H2")["kappa_trace"] = -0.9  # 1.85 / 0.15 = 12 tolerances
    head(cand, "L1H3")["kappa_trace"] = 0.0  # suppression lost: 0.7 / 0.15
    base = with_model(record(), fingerprint="sha256:" + "a" * 64)
    outcome = gate_build(FakeSession({"fp32": base}, cand), "fp32", "copying_heads", TOL, {})
    first, *rest = outcome.message().splitlines()
    assert first.startswith("copying_heads: L1H2 kappa_trace +0.950 -> -0.900 (tolerance 0.15)")
    assert rest[-1] == (
        "note: the weights differ from those the baseline was recorded from (weight fingerprint: baseline "
        "aaaaaaaaaaaa, this build bbbbbbbbbbbb; a sha256 over the name and sha256 of each weight file of the "
        "model folder, not any one file's); comparing the same geometry"
    )


def test_moved_most_lists_each_change_once_and_heads_first():
    """A broken build gated against the reference and its own baseline: copy_gain once, and the head."""
    from pytest_circuits.report import data, summary_lines

    gain = {"head": "model", "metric": "copy_gain", "before": 5.6, "after": 1.0, "tolerance": 0.25}
    kappa = {"head": "L1H0", "metric": "kappa_trace", "before": 0.9, "after": -0.9, "tolerance": 0.15}
    results = [
        {
            "invariant": "copy_loss",
            "build": "b",
            "against": against,
            "status": "failed",
            "message": "x",
            "moved": [gain],
        }
        for against in ("fp32 baseline", "own baseline")
    ] + [{"invariant": "copying_heads", "build": "b", "against": "own baseline", "status": "failed", "moved": [kappa]}]
    assert data.top_moved(results, 3) == [kappa, gain]
    line = next(l for l in summary_lines(results) if "moved most" in l)
    assert (
        line == "  moved most: L1H0 kappa_trace 0.900 -> -0.900 (tol 0.150); model copy_gain 5.600 -> 1.000 (tol 0.250)"
    )
