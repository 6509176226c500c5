"""The sequential rule of the sampled invariants (gate/sequential.py, record/looks.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pytest_circuits.gate.rows import sampled_within
from pytest_circuits.gate.sequential import boundaries, decide
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.record.looks import look_values
from pytest_circuits.record.seeds import look_seed

from .scan_records import typed

# Jennison & Turnbull (2000), Table 2.1 (Pocock C_P(K)) and Table 2.3 (O'Brien-Fleming C_B(K)):
# two-sided alpha = 0.05, K equally spaced looks, printed to 3 decimals
POCOCK = {1: 1.960, 2: 2.178, 3: 2.289, 4: 2.361, 5: 2.413}
OBRIEN_FLEMING = {1: 1.960, 2: 1.977, 3: 2.004, 4: 2.024, 5: 2.040}


@pytest.mark.parametrize("looks", sorted(POCOCK))
def test_boundaries_match_the_published_tables(looks):
    pocock = boundaries(looks, 0.05, "pocock")
    assert len(pocock) == looks and max(pocock) - min(pocock) < 1e-12
    assert pocock[0] == pytest.approx(POCOCK[looks], abs=1.5e-3)
    obf = boundaries(looks, 0.05, "obrien_fleming")
    assert obf[-1] == pytest.approx(OBRIEN_FLEMING[looks], abs=1.5e-3)  # C_B(K) is the last look's
    assert obf[0] == pytest.approx(obf[-1] * math.sqrt(looks), rel=1e-9)


def test_an_unknown_design_or_no_look_is_refused():
    with pytest.raises(ValueError, match="unknown sequential design"):
        boundaries(3, 0.05, "haybittle")
    with pytest.raises(ValueError, match="looks must be >= 1"):
        boundaries(0)


def simulate(mean: float, limit: float, trials: int, n: int = 16, looks: int = 4, seed: int = 0):
    """``(verdicts, looks used)`` of `decide` on normal paired differences N(mean, 1)."""
    rng = np.random.default_rng(seed)
    verdicts, used = [], []
    for _ in range(trials):
        draws = rng.normal(mean, 1.0, size=(looks, n))
        decision = decide(list(draws), limit, looks)
        verdicts.append(decision.verdict)
        used.append(decision.look)
    return np.array(verdicts), np.array(used)


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_change_exactly_at_the_tolerance_passes_at_most_alpha_over_two(sign):
    # the rule's type-I error: passing a build whose true change is its tolerance; bounded by
    # alpha / 2 = 0.025 (repeated intervals cover with 95% over all looks), within 3 Monte-Carlo sds
    trials, limit = 3000, 0.5
    verdicts, _ = simulate(sign * limit, limit, trials, seed=1 if sign > 0 else 2)
    rate = float(np.mean(verdicts == "pass"))
    assert set(verdicts) <= {"pass", "fail"}
    assert rate <= 0.025 + 3 * math.sqrt(0.025 * 0.975 / trials), rate


def test_clear_changes_take_one_look_and_a_marginal_one_takes_more():
    verdicts, used = simulate(0.0, 2.0, 200, seed=3)  # far within: every build passes at once
    assert (verdicts == "pass").all() and (used == 1).all()
    verdicts, used = simulate(5.0, 2.0, 200, seed=4)  # far beyond: every build fails at once
    assert (verdicts == "fail").all() and (used == 1).all()
    verdicts, used = simulate(0.25, 0.6, 400, seed=5)  # near the margin: more looks, most end within
    assert used.mean() > 1.5 and (verdicts == "pass").mean() > 0.5


def test_a_decision_names_its_sequences_and_waits_for_a_missing_look():
    rng = np.random.default_rng(6)
    parts = list(rng.normal(0.45, 1.0, size=(4, 16)))
    first = decide(parts[:1], 0.5, 4)
    assert first.verdict == "more" and first.sequences == 16 and first.look == 1
    again = decide(parts, 0.5, 4)
    assert again.look > 1 and again.sequences == 16 * again.look
    assert again.verdict in ("pass", "fail") or again.look < 4
    assert decide(parts, 0.5, 4) == again  # identical reruns
    assert "decided on" in again.said() and f"of {again.looks}" in again.said()
    assert decide([[1.0]], 0.5, 4) is None  # one sequence: no interval, the fixed rule applies


def test_look_seeds_are_the_probe_seed_first_then_fixed_and_distinct():
    assert look_seed(7, 1) == 7
    seeds = [look_seed(7, k) for k in range(2, 6)]
    assert seeds == [look_seed(7, k) for k in range(2, 6)]  # deterministic
    assert len(set(seeds + [7, look_seed(8, 2)])) == 6


def record(values, looks=()):
    """A minimal record: copy_loss with its sequences and further looks."""
    out = {"copy_loss": float(np.mean(values)), "copy_loss_sequences": list(values)}
    if len(looks):
        out["looks"] = [{"look": k, "copy_loss_sequences": list(v)} for k, v in enumerate(looks, start=2)]
    return typed(out)


def record_dict(values, looks=()):
    """`record` as the dict a baseline file holds."""
    return record(values, looks).data


def test_sampled_rows_take_the_sequential_rule_when_the_baseline_has_looks():
    rng = np.random.default_rng(8)
    base = rng.normal(1.0, 0.2, size=(4, 16))
    build = base + rng.normal(0.2, 0.2, size=(4, 16))  # a change near the tolerance 0.25
    tol = Tolerances()
    before = record(base[0], base[1:])
    old = record(base[0])  # a baseline recorded before the looks: the fixed rule, said
    row = sampled_within("model", "copy_loss", old, record(build[0]), 0.25, tol)
    assert "fixed rule on 16 sequences" in row.note and row.sequences == 16 and row.wants == 0

    def row_of(after):
        looks = (look_values(before, "copy_loss"), look_values(after, "copy_loss"))
        return sampled_within("model", "copy_loss", before, after, 0.25, tol, looks=looks)

    first = row_of(record(build[0]))
    assert first.wants == 2 and "undecided after look 1 of 4" in first.note
    final = row_of(record(build[0], build[1:]))
    assert final.wants == 0 and final.sequences > 16 and "decided on" in final.note
    fixed = sampled_within("model", "copy_loss", before, record(build[0]), 0.25, Tolerances().updated({"looks": 1}))
    assert "fixed rule" in fixed.note and fixed.wants == 0


def knockout_record(first, looks=()):
    """A record of one key head, L0H0, with its knockout deltas per sequence and further looks."""
    row = {"head": "L0H0", "layer": 0, "head_index": 0, "knockout_delta": float(np.mean(first))}
    row["knockout_delta_sequences"] = list(first)
    out = {"heads": [row], "knockout": {"mode": "zero", "seed": 1, "n": len(first), "L": 64}}
    if len(looks):
        out["looks"] = [{"look": k, "knockout_delta_sequences": {"L0H0": list(v)}} for k, v in enumerate(looks, 2)]
    return typed(out)


def test_the_knockout_tolerance_is_half_the_delta_over_every_sequence_the_baseline_holds():
    from pytest_circuits.gate.invariants import get

    rng = np.random.default_rng(11)
    base = rng.normal(0.13, 0.08, size=(4, 8))
    base[0] += 0.105 - base[0].mean()  # look 1 reads the delta low, as one seed's 8 sequences did on SmolLM2
    build = base + 0.041  # a steady change, as rtn-int8's on SmolLM2's L19H0
    tol = Tolerances()
    compare = get("knockout_deltas").compare
    row = compare(knockout_record(base[0], base[1:]), knockout_record(build[0], build[1:]), tol).rows[0]
    size = abs(float(np.mean(base)))  # every sequence: look 1 and the three further looks, by hand
    assert row.limit == pytest.approx(tol.knockout * size) and row.limit > tol.knockout * 0.105
    assert row.before == pytest.approx(0.105)  # the row still shows look 1's figures
    assert f"of its size {size:+.3f} over 32 sequences" in row.note
    assert not row.broken and "shown within" in row.note  # 0.041 against half the pooled size
    fixed = compare(knockout_record(base[0]), knockout_record(build[0]), tol).rows[0]
    assert fixed.limit == pytest.approx(tol.knockout * 0.105) and "over" not in fixed.note  # no looks: look 1


def test_key_knockout_heads_are_picked_by_their_delta_over_every_sequence():
    from pytest_circuits.gate.invariants import get, key_heads

    lifted = np.array([0.19, 0.17, 0.15, 0.13, 0.11, 0.09, 0.07, 0.05])  # look 1 reads 0.12: over min_delta
    low = np.full((3, 8), 0.02)  # the further looks read 0.02: over all 32 sequences 0.045, not a key head
    tol = Tolerances()
    lone = knockout_record(lifted)
    assert key_heads(lone, "knockout_delta", 0, tol.min_delta) == ["L0H0"]  # no looks: look 1 decides
    pooled_record = knockout_record(lifted, low)
    assert key_heads(pooled_record, "knockout_delta", 0, tol.min_delta) == []
    compared = get("knockout_deltas").compare(pooled_record, pooled_record, tol)
    assert not compared.rows and "no head with knockout delta >= 0.1" in compared.nothing


def test_the_run_measures_only_the_looks_an_undecided_row_asks_for():
    """The pure gate says which look an undecided row wants (`Verdicts.wants`); the run's flow
    (`run.flow.settle`) measures it on the baseline's seeds and asks again, until decided."""
    from pytest_circuits.record.schema import Record
    from pytest_circuits.run.flow import settle

    rng = np.random.default_rng(9)
    base = rng.normal(1.0, 0.2, size=(4, 16))
    z = rng.normal(size=(4, 16))
    z = (z - z.mean(axis=1, keepdims=True)) / z.std(axis=1, ddof=1, keepdims=True)
    # the copy loss changes by 0.2 +- 0.3 on look 1 (undecided against 0.25), by 0.05 +- 0.3 after
    build = base + np.array([0.2, 0.05, 0.05, 0.05])[:, None] + 0.3 * z

    class Source:  # a `RecordSource` that measures each look it is asked for
        def __init__(self):
            self.asked: list[tuple[int, int]] = []

        def look(self, build_name, k, probe_seed, knockout_seed, heads, mode):
            self.asked.append((k, probe_seed))
            assert probe_seed == look_seed(0, k) and not heads  # the baseline's seeds of that look
            return {
                "look": k,
                "probe_seed": probe_seed,
                "knockout_seed": knockout_seed,
                "copy_loss_sequences": list(build[k - 1]),
            }

    class MergedParts:  # a merge of shard parts: no build loaded, no look measured
        def look(self, *args):
            return None

    baseline = {
        **record_dict(base[0]),
        "copy_gain": 0.0,
        "copy_gain_sequences": [0.0] * 16,
        "looks": [
            {"look": k, "probe_seed": look_seed(0, k), "knockout_seed": look_seed(1, k), "copy_loss_sequences": list(v)}
            for k, v in enumerate(base[1:], start=2)
        ],
    }
    candidate = Record.of({**record_dict(build[0]), "copy_gain": 0.0, "copy_gain_sequences": [0.0] * 16})
    how = dict(label="fp32 baseline", invariants_checked=["copy_loss"], across=False)
    source = Source()
    out, verdicts = settle(source, "fp32", baseline, candidate, Tolerances(), **how)
    measured = source.asked
    assert [k for k, _ in measured] == list(range(2, 2 + len(measured))) and len(out.looks) == len(measured)
    assert 1 < len(measured) < 4 and verdicts.wants == 0  # decided before the last look
    again = Source()
    _, repeated = settle(again, "fp32", baseline, out, Tolerances(), **how)
    assert again.asked == [] and repeated.results[0].message == verdicts.results[0].message  # nothing measured twice
    merged, fixed = settle(MergedParts(), "fp32", baseline, candidate, Tolerances(), **how)
    assert merged.looks is None and fixed.wants == 2  # a merge job loads no build: the fixed rule, said
    assert "decided on 16 sequences (fixed rule)" in fixed.results[0].message


def test_looks_below_one_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"tolerance looks must be >= 1, got 0"):
        Tolerances().updated({"looks": 0})
    assert Tolerances().updated({"looks": "2"}).looks == 2


def test_a_baseline_of_implausible_spread_carries_no_evidence_for_the_sequential_rule_either():
    rng = np.random.default_rng(10)
    base = rng.normal(1.0, 0.05, size=(4, 16)) + 3.0  # + 3: the doctored copy losses stay >= 0
    build = base + 0.01 * rng.normal(size=(4, 16))
    doctored = base[0] + 1.0 + 3.0 * (-1.0) ** np.arange(16)  # moved 1 nat, spread +-3 (the means still move)
    before = record(doctored, base[1:])
    looks = (look_values(before, "copy_loss"), [])
    row = sampled_within("model", "copy_loss", before, record(build[0]), 0.25, Tolerances(), looks=looks)
    assert row.broken and "carry no evidence" in row.note and row.wants == 0


@pytest.mark.slow
def test_the_live_gate_draws_looks_for_an_undecided_change_and_reruns_alike(tmp_path, capsys):
    import json
    import re

    from pytest_circuits.cli import main
    from pytest_circuits.testing import save_tiny_model

    small = ["--device", "cpu", "--probe-n", "4", "--probe-length", "16"]
    model = save_tiny_model("gpt2", tmp_path / "m", seed=0)
    baselines = tmp_path / "baselines"
    assert main(["record", str(model), "--build", "fp32,rtn-int8", "--baselines", str(baselines), *small]) == 0
    before = json.loads((baselines / "m--fp32.json").read_text())
    after = json.loads((baselines / "m--rtn-int8.json").read_text())
    assert [e["look"] for e in before["looks"]] == [2, 3, 4]  # recorded once with every look
    assert before["looks"][0]["probe_seed"] == look_seed(before["probe"]["seed"], 2)
    change = np.mean(np.subtract(after["copy_loss_sequences"], before["copy_loss_sequences"]))
    tight = f"copy_loss={abs(change) * 1.01 + 1e-6:.9f}"  # the first look's interval straddles it
    gate = ["gate", str(model), "--build", "rtn-int8", "--baseline", str(baselines / "m--fp32.json"), *small]
    outs = []
    for _ in range(2):
        main([*gate, "--tol", tight])
        outs.append([line for line in capsys.readouterr().out.splitlines() if "copy_loss" in line])
    assert outs[0] == outs[1]  # identical reruns
    text = "\n".join(outs[0])
    looks = [int(k) for k in re.findall(r"\(look (\d) of 4\)", text)]
    assert looks and max(looks) >= 2 and f"decided on {4 * max(looks)} sequences" in text, text


def _shipped(name: str) -> dict:
    import json
    from importlib.resources import files

    return json.loads(files("pytest_circuits").joinpath("baselines", f"{name}.json").read_text())


def test_a_further_look_knocks_out_only_the_heads_still_undecided():
    """`run.looks.measure_looks` asks a look for the knockouts of the undecided rows only; the verdicts
    are those of a run that knocked out every key head on every look (`decide` stops at a row's
    decision, so a decided head reads no later look)."""
    from pytest_circuits.record.schema import Record
    from pytest_circuits.run.flow import settle

    baseline = _shipped("tiny-induction--fp32")
    rng = np.random.default_rng(11)
    # per head, the change of each look's 8 per-sequence deltas: L1H0 far beyond (fails on look 1),
    # L0H1 none (passes on look 1), L0H2 noisy on look 1 only, L0H3 noisy near its limit (0.15) on every look
    change = {
        "L1H0": lambda k: np.full(8, 5.0) + 0.1 * rng.normal(size=8),
        "L0H1": lambda k: np.zeros(8),
        "L0H2": lambda k: 0.3 * rng.normal(size=8) if k == 1 else np.zeros(8),  # undecided, then decided
        "L0H3": lambda k: 0.12 + 0.3 * rng.normal(size=8),
    }
    changes = {head: [f(k) for k in range(1, 5)] for head, f in change.items()}
    candidate = {key: value for key, value in baseline.items() if key != "looks"}
    candidate["heads"] = [dict(row) for row in baseline["heads"]]
    for row in candidate["heads"]:
        if row["head"] in changes:
            values = np.asarray(row["knockout_delta_sequences"]) + changes[row["head"]][0]
            row["knockout_delta_sequences"], row["knockout_delta"] = values.tolist(), float(values.mean())

    class Source:  # a `RecordSource` measuring the baseline's look plus the change, of the heads asked
        def __init__(self, every_head: bool):
            self.every_head, self.asked = every_head, []

        def look(self, build_name, k, probe_seed, knockout_seed, heads, mode):
            stored = baseline["looks"][k - 2]
            heads = sorted(stored["knockout_delta_sequences"]) if self.every_head else heads
            self.asked.append((k, tuple(heads)))
            knocked = {
                h: (np.asarray(stored["knockout_delta_sequences"][h]) + changes[h][k - 1]).tolist() for h in heads
            }
            return {
                **{key: v for key, v in stored.items() if key != "knockout_delta_sequences"},
                "knockout_delta_sequences": knocked,
            }

    how = dict(label="fp32 baseline", invariants_checked=["knockout_deltas"], across=False)
    undecided, every = Source(every_head=False), Source(every_head=True)
    _, fast = settle(undecided, "fp32", baseline, Record.of(candidate), Tolerances(), **how)
    _, full = settle(every, "fp32", baseline, Record.of(candidate), Tolerances(), **how)
    asked = [set(heads) for _, heads in undecided.asked]
    assert asked[0] == {"L0H2", "L0H3"} and asked[-1] == {"L0H3"}  # L0H2 decided on look 2: not asked again
    assert all(later <= earlier for earlier, later in zip(asked, asked[1:]))
    assert [k for k, _ in undecided.asked] == [k for k, _ in every.asked]  # the same looks, fewer knockouts
    assert fast.results[0].message == full.results[0].message and fast.results[0].status == "failed"
    assert "L1H0" in fast.results[0].message and "decided on 8 sequences (look 1 of 4)" in fast.results[0].message
