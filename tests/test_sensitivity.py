"""The sensitivity sweep: each damage checked against a forward pass, exact restores, the gate's
verdicts on the embedded model, and ``circuits sensitivity``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_circuits.cli import main
from pytest_circuits.model.families import geometry_of, out_proj_module
from pytest_circuits.run.sensitivity import Damage, Outcome, Restorer, caught_table, gate_outcome, sweep
from pytest_circuits.testing import make_tiny_model, requires_embedded_model, requires_smollm2

from .conftest import SHIPPED_BASELINES

needs_embedded = requires_embedded_model()
needs_smollm2 = requires_smollm2()
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def head_outputs(model, layer: int, ids) -> list[torch.Tensor]:
    """What each head of ``layer`` writes: the output projection run with every other head's z zeroed."""
    geo = geometry_of(model)
    proj = out_proj_module(model, layer)
    outs = []
    for h in range(geo.n_heads):
        captured = {}

        def keep_one(module, args, h=h, captured=captured):
            z = args[0].clone()
            mask = torch.zeros(z.shape[-1], dtype=z.dtype)
            mask[h * geo.d_head : (h + 1) * geo.d_head] = 1
            captured["z"] = z * mask
            return (captured["z"],)

        hook = proj.register_forward_pre_hook(keep_one)
        with torch.no_grad():
            model(input_ids=ids)
            outs.append(proj(captured["z"]).detach().clone())
        hook.remove()
    return outs


def without_bias(model, layer, outs):
    bias = getattr(out_proj_module(model, layer), "bias", None)
    return [o - bias if bias is not None else o for o in outs]


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama"])
@pytest.mark.parametrize("s", [0.5, -1.0])
def test_ov_scale_multiplies_that_heads_output_only(family, s):
    model = make_tiny_model(family, seed=4)
    before = without_bias(model, 1, head_outputs(model, 1, IDS))
    Damage("ov_scale", s, "L1H2").apply(model)
    after = without_bias(model, 1, head_outputs(model, 1, IDS))
    assert torch.allclose(after[2], s * before[2], atol=1e-5)
    assert not torch.allclose(before[2], torch.zeros_like(before[2]))
    for h in (0, 1, 3):
        assert torch.allclose(after[h], before[h], atol=1e-6)


def attention(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, output_attentions=True).attentions


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama"])
def test_qk_scale_multiplies_that_heads_attention_logits(family):
    """log A' - t log A is constant along each row (softmax of t x logits), other heads unchanged;
    on llama (grouped-query: K shared by L0H0 and L0H1) the group's other head keeps its pattern."""
    model = make_tiny_model(family, seed=5)
    t = 0.5
    before = attention(model, IDS)[0]
    Damage("qk_scale", t, "L0H1").apply(model)
    after = attention(model, IDS)[0]
    T = IDS.shape[1]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    gap = (after[:, 1].log() - t * before[:, 1].log()).masked_fill(~causal, float("nan"))
    spread = gap.nan_to_num(0) - gap.nanmean(-1, keepdim=True).nan_to_num(0)
    assert float(spread.masked_fill(~causal, 0).abs().max()) < 1e-4
    assert not torch.allclose(after[:, 1], before[:, 1], atol=1e-3)
    for h in (0, 2, 3):
        assert torch.allclose(after[:, h], before[:, h], atol=1e-6)


def test_rotation_by_90_degrees_writes_into_the_next_heads_subspace():
    model = make_tiny_model("llama", seed=6)
    before = head_outputs(model, 0, IDS)
    Damage("ov_rotate", 90.0, "L0H0").apply(model)
    after = head_outputs(model, 0, IDS)
    # the span of what L0H1 can write: the rows of its W_O (d_head of them), from the intact weights
    geo = geometry_of(model)
    w_o1 = out_proj_module(model, 0).weight.detach()[:, geo.d_head : 2 * geo.d_head]  # (d_model, d_head)
    basis, _ = torch.linalg.qr(w_o1)
    out = after[0].reshape(-1, after[0].shape[-1])
    residual = out - out @ basis @ basis.T
    assert float(residual.norm() / out.norm()) < 1e-5
    intact = before[0].reshape(-1, out.shape[-1])
    assert float((intact - intact @ basis @ basis.T).norm() / intact.norm()) > 0.1


def test_noise_and_low_rank_have_the_asked_size_and_stay_in_their_layers():
    model = make_tiny_model("llama", seed=7)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Damage("noise_layer", 0.1, "L1H0").apply(model)
    for name, p in model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved == (name.startswith("model.layers.1.") and p.dim() == 2), name
        if moved:
            rel = (p.detach() - before[name]).norm() / before[name].norm()
            assert 0.08 < float(rel) < 0.12, name
    restorer = Restorer(model)
    Damage("low_rank", 0.3).apply(model)
    for name, p in model.named_parameters():
        if name.startswith("model.layers.") and p.dim() == 2:
            change = p.detach() - restorer.saved[name]
            assert float(change.norm() / restorer.saved[name].norm()) == pytest.approx(0.3, rel=1e-3)
            assert int(torch.linalg.matrix_rank(change)) <= 8
    restorer.restore()
    assert all(torch.equal(p, restorer.saved[n]) for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def embedded_gate():
    """A session on the embedded model's fp32 build and its shipped baseline."""
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record.store import read_baseline
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    session = Run(CircuitsSettings(model="tiny-induction", device="cpu"))
    baseline = read_baseline(SHIPPED_BASELINES / "tiny-induction--fp32.json")
    return session, baseline, Tolerances()


@needs_embedded
def test_negated_induction_head_is_caught_and_a_benign_scale_is_not(embedded_gate):
    session, baseline, tol = embedded_gate
    weights = {n: p.detach().clone() for n, p in session.loaded.build("fp32").model.named_parameters()}
    outcomes = sweep(session, baseline, [Damage("ov_scale", -1.0, "L1H0"), Damage("ov_scale", 0.99, "L1H0")], tol)
    intact, negated, benign = outcomes
    assert intact.passed and not intact.failed
    assert {"copying_heads", "copy_loss"} <= set(negated.failed)
    [copying] = [r for r in negated.results if r.invariant == "copying_heads"]
    assert "L1H0" in copying.message
    assert not benign.failed and benign.passed
    # every weight is back, bit for bit, and the intact build gates as before
    for name, p in session.loaded.build("fp32").model.named_parameters():
        assert torch.equal(p, weights[name]), name
    again = gate_outcome(session, "fp32", baseline, tol)
    assert again.copy_loss == intact.copy_loss and not again.failed
    table = "\n".join(caught_table(outcomes[1:], ["copying_heads", "copy_loss"]))
    assert "| L1H0 OV x s | negated | negated | negated |" in table


@needs_embedded
def test_circuits_sensitivity_prints_the_mildest_damage_caught(capsys):
    assert main(["sensitivity", "tiny-induction", "--heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "damaging L1H0 of fp32" in out
    assert "L1H0 OV negated: FAIL copying_heads" in out
    rows = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("| L1H0")}
    assert set(rows) == {"| L1H0 OV x s", "| L1H0 QK logits x t"}


def test_circuits_sensitivity_refuses_bad_input(capsys):
    assert main(["sensitivity", "tiny-induction", "--heads", "0"]) == 2
    assert "--heads 0" in capsys.readouterr().err


def test_an_invariant_that_compared_nothing_is_not_counted_as_catching_a_damage(monkeypatch):
    """The gate fails when an invariant compared nothing, but no move was measured: the sweep must
    not read that as the damage caught (it is listed apart, and the gate column stays ``no``)."""
    import pytest_circuits.run.sensitivity as S
    from pytest_circuits.gate.invariant_api import InvariantResult

    from .scan_records import typed

    results = [
        InvariantResult("copy_loss", "fp32", "baseline", "passed", "held", compared=1),
        InvariantResult("knockout_deltas", "fp32", "baseline", "failed", "compared nothing", compared=0),
    ]
    record = typed({"copy_loss": 1.0, "first_copy_loss": 2.0, "copy_gain": 1.0})
    monkeypatch.setattr(S, "gate_record", lambda *a, **k: (results, record))
    damage = Damage("ov_scale", 0.5, "L1H0")
    outcome = S.gate_outcome(None, "fp32", {}, None, damage)
    assert outcome.failed == [] and outcome.empty == ["knockout_deltas"]
    assert outcome.verdict() == "compared nothing: knockout_deltas"
    cells = S.smallest_caught([outcome], ["copy_loss", "knockout_deltas"])["L1H0 OV x s"]
    assert cells == {"copy_loss": None, "knockout_deltas": None, "any": None}
    results[0] = InvariantResult("copy_loss", "fp32", "baseline", "failed", "moved", compared=1)
    caught = S.gate_outcome(None, "fp32", {}, None, damage)
    assert caught.failed == ["copy_loss"] and S.smallest_caught([caught], ["copy_loss"])["L1H0 OV x s"]["any"] is damage


def _sensitivity_script(monkeypatch):
    """``scripts/measure_sensitivity.py`` as a module."""
    import importlib.util

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    monkeypatch.syspath_prepend(str(scripts))
    spec = importlib.util.spec_from_file_location("measure_sensitivity", scripts / "measure_sensitivity.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_false_alarm_trials_split_over_runs_tally_as_one(tmp_path, monkeypatch):
    """``scripts/measure_sensitivity.py --seeds A-B --trials F`` keeps each trial; ``--kept F1,F2`` counts
    them as one sweep: per invariant the failures over the trials it ran (a skip is no trial), the whole
    gate failing wherever any invariant did, and a seed and build kept twice refused."""
    import json

    script = _sensitivity_script(monkeypatch)
    assert list(script.seed_range("3")) == [1, 2, 3] and list(script.seed_range("6-10")) == [6, 7, 8, 9, 10]
    assert not script.seed_range("0")
    with pytest.raises(SystemExit, match="--seeds 1-x"):
        script.seed_range("1-x")

    def trial(seed, build, knockout="passed", copy="passed"):
        status = {"copy_loss": copy, "knockout_deltas": knockout}
        return {"seed": seed, "build": build, "status": status, "used": {"copy_loss": 0.1 * seed}}

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps(trial(2, "bf16", knockout="failed")) + "\n" + json.dumps(trial(1, "bf16")) + "\n")
    second.write_text(json.dumps(trial(3, "bf16", knockout="skipped")) + "\n")
    counts, lines, most = script.tally(script.read_kept(f"{first},{second}")[0])
    assert counts["knockout_deltas"] == (1, 2) and counts["copy_loss"] == (0, 3) and counts["gate"] == (1, 3)
    assert lines == [
        "| 1 | bf16 | pass | copy_loss n/a / 0.10 |",
        "| 2 | bf16 | FAIL knockout_deltas | copy_loss n/a / 0.20 |",
        "| 3 | bf16 | pass | copy_loss n/a / 0.30 |",
    ]
    assert most == {"copy_loss": pytest.approx(0.3)}
    rows = "\n".join(script.rate_rows(counts, most))
    assert "| `knockout_deltas` | 1 / 2 | 0.500 |" in rows and "| the whole gate | 1 / 3 | 0.333 |" in rows
    with pytest.raises(SystemExit, match="kept twice"):
        script.read_kept(f"{first},{first}")
    with pytest.raises(SystemExit, match="cannot read the kept trials"):
        script.read_kept(str(tmp_path / "missing.jsonl"))


def test_trials_alone_are_said_as_one_sweep_with_each_rule_s_margin(monkeypatch):
    """A sweep split over processes (a seed range and a --trials file each) is said as one command;
    each trial's row gives how near each sampled invariant came to its tolerance under the fixed and
    the sequential rule, with the sequences that decided it; with no damage gated the side-by-side
    table has no damage columns."""
    script = _sensitivity_script(monkeypatch)
    base = "python scripts/measure_sensitivity.py --models m --seeds {} --trials /tmp/x/{} --tag t"
    trials = [
        {
            "seed": seed,
            "build": "rtn-int8",
            "command": base.format(f"{seed}-{seed}", f"ko-{seed}.jsonl"),
            "status": {"copy_loss": "passed", "knockout_deltas": "passed"},
            "fixed_status": {"copy_loss": "passed", "knockout_deltas": "failed" if seed == 2 else "passed"},
            "used": {"copy_loss": 0.4, "knockout_deltas": 0.79},
            "fixed_used": {"copy_loss": 0.4, "knockout_deltas": 0.88},
            "sequences": {"copy_loss": 8, "knockout_deltas": 8 * seed},
        }
        for seed in (1, 2)
    ]
    said = script.trials_said(trials, "unused")
    assert said.count("`") == 2 and "--seeds A-B --trials FILE --tag t" in said and "/tmp/x" not in said
    _, lines, _ = script.tally(trials)
    assert lines[1] == "| 2 | rtn-int8 | pass | copy_loss 0.40 / 0.40 (8); knockout_deltas 0.88 / 0.79 (16) |"
    rows = script.rules_rows(trials, [], [])
    assert all(row.count("|") == 6 for row in rows), rows  # five columns: no damage was gated
    assert "| `knockout_deltas` | 1 / 2 [" in rows[3] and "| 0.88 / 0.79 | 12.0 |" in rows[3]


@needs_smollm2
def test_smollm2_s_side_by_side_tables_are_what_its_kept_files_count(tmp_path, monkeypatch, capsys):
    """docs/sensitivity.md's tables of SmolLM2 under both rules are what the commands it gives count
    from the trials and verdicts kept in docs/measured/ (one command per kept set): run on a copy of
    the page, each leaves the page as it is."""
    import shlex

    script = _sensitivity_script(monkeypatch)
    shown = script.PAGE.read_text(encoding="utf-8")
    page = tmp_path / "sensitivity.md"
    page.write_text(shown, encoding="utf-8")
    monkeypatch.setattr(script, "PAGE", page)
    monkeypatch.chdir(script.ROOT)  # the command names the kept files from the repository's root
    commands = [line for line in shown.splitlines() if line.startswith("python ") and "--kept docs/measured/" in line]
    assert commands, "docs/sensitivity.md gives no --kept command"
    for command in commands:
        script.main(shlex.split(command)[2:])
        assert "rewrote 3 blocks" in capsys.readouterr().out  # the rules, the false alarms, every trial: compared
        assert page.read_text(encoding="utf-8") == shown, f"docs/sensitivity.md is not what {command!r} counts"


def test_a_kept_damage_grid_joins_the_side_by_side_table(tmp_path, monkeypatch):
    """A grid run with ``--trials`` keeps each damage's verdicts under both rules; ``--kept`` reads them
    back beside the false-alarm trials, so one run that measures nothing tables both: the damages
    each rule caught, the verdicts they differ on and the fixed rule's mildest catch."""
    import json

    script = _sensitivity_script(monkeypatch)
    mild, strong = Damage("ov_scale", 0.9, "L1H0"), Damage("ov_scale", 0.5, "L1H0")
    nan = float("nan")
    gated = [
        (Outcome(None, "intact", [], ["knockout_deltas"], nan, nan, nan), {"passed"}),
        (Outcome(mild, "L1H0 OV x0.9", ["knockout_deltas"], [], nan, nan, nan), {"passed"}),
        (Outcome(strong, "L1H0 OV x0.5", ["knockout_deltas"], [], nan, nan, nan), {"failed"}),
    ]
    kept = tmp_path / "grid.jsonl"
    with kept.open("w") as out:
        for outcome, fixed in gated:
            rules = {"fixed": {"knockout_deltas": fixed.pop()}, "sequences": {"knockout_deltas": 24}}
            out.write(json.dumps({**script.verdict_line(outcome, rules), "command": "grid --trials /x/g.jsonl"}) + "\n")
    trial = {"seed": 1, "build": "bf16", "status": {"knockout_deltas": "passed"}, "used": {"knockout_deltas": 0.4}}
    (tmp_path / "t.jsonl").write_text(json.dumps({**trial, "fixed_status": trial["status"]}) + "\n")
    trials, judged = script.read_kept(f"{tmp_path / 't.jsonl'},{kept}")
    assert [t["build"] for t in trials] == ["bf16"] and [o.label for o, _ in judged] == [o.label for o, _ in gated]
    assert judged[1][0].damage == mild and judged[1][1]["command"] == "grid --trials /x/g.jsonl"
    outcomes, rules = [o for o, _ in judged], [r for _, r in judged]
    rows = script.rules_rows(trials, outcomes, rules)
    assert "| 1 / 2 of 2 | 24.0 |" in rows[3] and "| 0 / 1 [" in rows[3]  # fixed caught 1, sequential 2
    assert any("L1H0 OV x0.9 | pass | FAIL knockout_deltas" in row for row in script.differing_rows(outcomes, rules))
    with pytest.raises(SystemExit, match="kept twice"):
        script.read_kept(f"{kept},{kept}")


def test_the_share_of_a_tolerance_a_build_used_reads_the_stored_records(monkeypatch):
    """The script's `tolerance_used` and `rule_figures` take the record dicts a file or a scan gives
    (the invariants compare typed records): rtn-int4 against fp32 of the shipped embedded-model
    baselines, ``copy_loss``'s share under the fixed rule being its larger change over its tolerance."""
    from pytest_circuits.record.store import read_baseline

    script = _sensitivity_script(monkeypatch)
    folder = Path(__file__).resolve().parent.parent / "baselines"
    fp32, int4 = (read_baseline(folder / f"tiny-induction--{b}.json") for b in ("fp32", "rtn-int4"))
    used = script.tolerance_used(fp32, int4, script.FIXED)
    assert set(used) == set(script.per_build_invariants())
    largest = max(abs(int4[f] - fp32[f]) for f in ("copy_loss", "copy_gain"))
    assert used["copy_loss"] == pytest.approx(largest / script.FIXED.copy_loss, rel=1e-4)  # stored to 6 digits
    figures = script.rule_figures(fp32, int4, script.Tolerances(), "rtn-int4")
    assert figures["fixed"]["copy_loss"] in ("passed", "failed") and figures["sequences"]["copy_loss"] >= 8


@needs_embedded
def test_ov_gain_sees_the_key_head_weakened_that_kappa_cannot(embedded_gate):
    """OV x 0.9 of the induction head: its recorded OV gain is 0.9 times the intact one (the gain is
    linear in ``W_O``), so ``ov_gain`` fails naming L1H0 while both kappa invariants, scale-free by
    construction, pass; OV x 0.95 stays within the default 0.1 of ``|ln ratio|``."""
    import math

    session, baseline, tol = embedded_gate
    intact, weaker, slight = sweep(
        session, baseline, [Damage("ov_scale", 0.9, "L1H0"), Damage("ov_scale", 0.95, "L1H0")], tol, knockout=False
    )
    gains = {row["head"]: row["ov_gain"] for row in intact.record["heads"]}
    damaged = {row["head"]: row["ov_gain"] for row in weaker.record["heads"]}
    assert damaged["L1H0"] == pytest.approx(0.9 * gains["L1H0"], rel=1e-4)
    assert all(damaged[h] == pytest.approx(g, rel=1e-6) for h, g in gains.items() if h != "L1H0")
    assert "ov_gain" in weaker.failed and not {"copying_heads", "kappa_distribution"} & set(weaker.failed)
    [result] = [r for r in weaker.results if r.invariant == "ov_gain"]
    assert "L1H0" in result.message and "(x0.900)" in result.message and result.compared == 4
    [row] = result.moved
    assert row["change"] == pytest.approx(math.log(0.9), abs=1e-4) and row["tolerance"] == tol.ov_gain
    assert "ov_gain" in slight.passed and "ov_gain" in intact.passed
