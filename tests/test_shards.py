"""Shards as separate jobs: K pytest processes that share no folder write parts, the same bytes as
``circuits record --shard``; the merge is the unsharded record, bit for bit."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_circuits.cli import main
from pytest_circuits.errors import ShardError
from pytest_circuits.gate.invariants import per_build_invariants
from pytest_circuits.options import parse_shard
from pytest_circuits.record.shards import merge_parts, read_part
from pytest_circuits.run.run import Run
from pytest_circuits.settings import build_settings, check_shard_job

from .conftest import needs_embedded

ONE_MODEL = len(per_build_invariants())  # the gate suite's tests of one build, one per invariant
# deselected: the unsharded knockout shard test, and the opt-in invariants' (rung 3: no audit slice given)

ROOT = Path(__file__).resolve().parent.parent
PROBE = ["--probe-n", "4", "--probe-length", "16"]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Two ``circuits record --shard`` jobs of the embedded model's fp32 record, each in a folder of
    its own with its own cache, their parts gathered in one folder. They run in this process: the
    pytest shard jobs below are the separate processes, and their parts must be these, byte for byte."""
    root = tmp_path_factory.mktemp("jobs")
    gathered = root / "gathered"
    gathered.mkdir()
    for i in (1, 2):
        folder = root / f"job{i}"
        folder.mkdir()
        said = io.StringIO()
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(said):
            patch.chdir(folder)
            patch.setenv("PYTEST_CIRCUITS_CACHE", str(folder / "cache"))
            words = ["record", "tiny-induction", "--build", "fp32", "--shard", f"{i}/2", "--out", f"part-{i}.json"]
            assert main([*words, *PROBE]) == 0
        assert f"shard {i}/2 of fp32" in said.getvalue()
        (gathered / f"part-{i}.json").write_bytes((folder / f"part-{i}.json").read_bytes())
    return gathered


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The unsharded record of the embedded model's fp32 build (``circuits record``): a baselines folder."""
    folder = tmp_path_factory.mktemp("whole")
    assert main(["record", "tiny-induction", "--build", "fp32", "--baselines", str(folder), *PROBE]) == 0
    return folder


@needs_embedded
def without_looks(path: Path) -> bytes:
    """The unsharded baseline's bytes without its further looks (record/looks.py): a merge of shard parts
    loads no build, so it measures none, and its baseline gates by the fixed rule (said in the verdict)."""
    from pytest_circuits.record.store import dumps

    record = json.loads(path.read_text())
    assert record.pop("looks")  # an unsharded record holds them
    return dumps(record).encode()


def test_cli_shard_jobs_merge_to_the_unsharded_record_bit_for_bit(parts, whole, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["merge", str(parts / "part-2.json"), str(parts / "part-1.json"), "-o", "merged.json"]) == 0
    merged = Path("merged.json").read_bytes()
    assert merged == without_looks(whole / "tiny-induction--fp32.json")
    record = json.loads(merged)
    assert all(row["knockout_delta"] is not None for row in record["heads"])  # every layer from its owner
    one = read_part(parts / "part-1.json")
    assert one["part"]["layers"] == [0] and any(r["knockout_delta"] is None for r in one["record"]["heads"])


@needs_embedded
def test_merge_refuses_parts_of_other_weights_settings_or_splits(parts, tmp_path, capsys):
    one, two = read_part(parts / "part-1.json"), read_part(parts / "part-2.json")
    other = copy.deepcopy(two)
    other["record"]["model"]["fingerprint"] = "sha256:" + "0" * 64
    with pytest.raises(ShardError, match=r"b differs from a in model.fingerprint \(other weights or another model\)"):
        merge_parts([("a", one), ("b", other)])
    other = copy.deepcopy(two)
    other["record"]["build"]["recipe"] = "bf16"
    with pytest.raises(ShardError, match=r"in build.recipe \(another build\)"):
        merge_parts([("a", one), ("b", other)])
    other = copy.deepcopy(two)
    other["record"]["probe"]["seed"] = 8
    with pytest.raises(ShardError, match=r"in probe.seed \(other probe settings\)"):
        merge_parts([("a", one), ("b", other)])
    with pytest.raises(ShardError, match="a and b are both shard 1/2"):
        merge_parts([("a", one), ("b", one)])
    with pytest.raises(ShardError, match="shard\\(s\\) 2/2 missing: merge all 2 parts"):
        merge_parts([("a", one)])
    (tmp_path / "plain.json").write_text(json.dumps(one["record"]))
    assert main(["merge", str(tmp_path / "plain.json"), "-o", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert "plain.json is not a shard part (circuits record --shard i/K --out FILE writes one)" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "m.json").exists()


def test_shard_words_are_checked_in_one_line(capsys):
    assert parse_shard("2/4") == (2, 4)
    for bad in ("2", "0/4", "5/4", "a/b"):
        with pytest.raises(ShardError, match="--shard"):
            parse_shard(bad)
    assert main(["record", "tiny-induction", "--build", "fp32", "--shard", "1/2"]) == 2
    assert "--shard 1/2 needs --out FILE" in capsys.readouterr().err
    assert main(["record", "tiny-induction", "--build", "fp32", "--out", "x.json"]) == 2
    assert "--out writes a shard's part: give --shard I/K too" in capsys.readouterr().err


# ---------------------------------------------------------------- the same from pytest

GATE_SUITE = "from pytest_circuits.probes import *  # noqa: F401,F403\n"
PYTEST_OPTIONS = [
    "--circuits-model",
    "tiny-induction",
    "--circuits-builds",
    "fp32",
    "--circuits-baselines",
    "baselines",
]
PYTEST_PROBE = ["--circuits-probe-n", "4", "--circuits-probe-length", "16"]


def _pytest_job(folder: Path, baselines: Path, *words: str) -> subprocess.Popen:
    """``pytest`` of the gate suite in a process of its own, in its own folder: its own rootdir, model
    cache and copy of the baselines (as a CI job has its checkout)."""
    folder.mkdir(parents=True)
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "test_gate.py").write_text(GATE_SUITE)
    shutil.copytree(baselines, folder / "baselines")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_CIRCUITS_CACHE": str(folder / "cache")}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfs", *PYTEST_OPTIONS, *PYTEST_PROBE, *words]
    return subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def pytest_parts(tmp_path_factory, whole):
    """Two pytest shard jobs of the gate suite (run at once, no folder shared), their parts gathered
    in one folder; ``(folder, {i: output})``."""
    root = tmp_path_factory.mktemp("pytest-jobs")
    jobs = {
        i: _pytest_job(root / f"job{i}", whole, "--circuits-shard", f"{i}/2", "--circuits-shard-out", f"part-{i}.json")
        for i in (1, 2)
    }
    gathered = root / "gathered"
    gathered.mkdir()
    outputs = {}
    for i, job in jobs.items():
        outputs[i], _ = job.communicate(timeout=600)
        assert job.returncode == 0, outputs[i][-3000:]
        (gathered / f"part-{i}.json").write_bytes((root / f"job{i}" / f"part-{i}.json").read_bytes())
    return gathered, outputs


@needs_embedded
def test_pytest_shard_jobs_write_the_cli_parts_and_merge_to_the_unsharded_record(pytest_parts, parts, whole, tmp_path):
    """One writer: each pytest job's part is the CLI job's, byte for byte, so ``circuits merge`` takes
    any mix of them; merged, they are the unsharded record, bit for bit."""
    gathered, _ = pytest_parts
    for i in (1, 2):
        assert (gathered / f"part-{i}.json").read_bytes() == (parts / f"part-{i}.json").read_bytes()
    unsharded = without_looks(whole / "tiny-induction--fp32.json")
    assert (
        main(["merge", str(gathered / "part-1.json"), str(gathered / "part-2.json"), "-o", str(tmp_path / "a.json")])
        == 0
    )
    assert (tmp_path / "a.json").read_bytes() == unsharded
    assert (
        main(["merge", str(parts / "part-1.json"), str(gathered / "part-2.json"), "-o", str(tmp_path / "b.json")]) == 0
    )
    assert (tmp_path / "b.json").read_bytes() == unsharded


@needs_embedded
def test_a_pytest_shard_job_says_it_did_not_gate_rung_2(pytest_parts):
    """Rungs 1 and 1/2 gated; rung 2 skipped with why, never passed; the summary names the part."""
    _, outputs = pytest_parts
    layers = {1: "0", 2: "1"}
    for i, out in outputs.items():
        assert f"shard {i}/2 of fp32: wrote part-{i}.json (knockouts of layers {layers[i]} only)" in out
        assert f"NOTE rung 2 not gated by this job, which measured only knockout shard {i}/2" in out
        assert "skip swap_knockout, knockout_deltas: rung 2 not gated by this job" in out
        held = next(line for line in out.splitlines() if line.startswith("  pass "))
        assert "copying_heads" in held and "knockout" not in held
        # passed: every invariant but knockout_deltas, and test_knockout_shard (the part written);
        # skipped: knockout_deltas and the base-model swap
        assert f"{ONE_MODEL - 1 + 1} passed, 2 skipped" in out


def _damaged(part: dict, label: str, factor: float) -> dict:
    """``part`` with head ``label``'s knockout figures (delta, interval, per-sequence) times ``factor``."""
    part = copy.deepcopy(part)
    row = next(r for r in part["record"]["heads"] if r["head"] == label)
    row["knockout_delta"] *= factor
    row["knockout_delta_interval"] = [x * factor for x in row["knockout_delta_interval"]]
    row["knockout_delta_sequences"] = [x * factor for x in row["knockout_delta_sequences"]]
    return part


@needs_embedded
def test_the_merge_job_gates_the_parts_knockouts_without_loading_the_build(pytest_parts, whole, pytester, tmp_path):
    """``--circuits-shard-parts``: the gate reads the merged parts, rung 2 included (a part whose
    strongest head lost two thirds of its knockout effect fails knockout_deltas naming it) and loads nothing."""
    gathered, _ = pytest_parts
    record = json.loads((whole / "tiny-induction--fp32.json").read_text())
    top = max(record["heads"], key=lambda row: row["knockout_delta"])
    assert top["layer"] == 1  # owned by part 2
    folder = tmp_path / "parts"
    folder.mkdir()
    shutil.copy(gathered / "part-1.json", folder)
    (folder / "part-2.json").write_text(json.dumps(_damaged(read_part(gathered / "part-2.json"), top["head"], 1 / 3)))
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_gate=GATE_SUITE)
    shutil.copytree(whole, pytester.path / "baselines")
    pattern = str(folder / "part-*.json")
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "-rfs", *PYTEST_OPTIONS, *PYTEST_PROBE, "--circuits-shard-parts", pattern
    )
    out = "\n".join(result.outlines + result.errlines)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    result.assert_outcomes(
        passed=ONE_MODEL - 1, failed=1, skipped=1
    )  # skipped: no base-model swap; no shard test collected
    assert "FAILED test_gate.py::test_knockout_deltas_keep_size[fp32]" in out
    assert f"FAIL knockout_deltas: knockout_deltas: {top['head']} knockout_delta" in out
    assert f"gated the record merged from the shard parts {pattern} (the build was not loaded)" in out
    assert "builds loaded" not in out


@needs_embedded
def test_the_merge_job_records_the_merged_parts_as_the_unsharded_baseline(pytest_parts, whole, pytester):
    """``--circuits-shard-parts DIR --circuits-update``: the baseline written is the unsharded record, bit for
    bit, but for the further looks of the sequential rule, which a merge (no build loaded) cannot measure."""
    gathered, _ = pytest_parts
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_gate=GATE_SUITE)
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        *PYTEST_OPTIONS,
        *PYTEST_PROBE,
        "--circuits-shard-parts",
        str(gathered),
        "--circuits-update",
    )
    result.assert_outcomes(passed=ONE_MODEL, skipped=1)  # skipped: no base-model swap; no shard test collected
    written = pytester.path / "baselines" / "tiny-induction--fp32.json"
    assert written.read_bytes() == without_looks(whole / "tiny-induction--fp32.json")


def test_a_shard_job_that_wrote_no_part_fails(pytester):
    """A shard job whose shard test did not run (here: a suite without it) has not done its job: exit 1, one line."""
    pytester.makepyfile(test_other="def test_other():\n    pass\n")
    result = pytester.runpytest(
        "-p", "no:cacheprovider", *PYTEST_OPTIONS, "--circuits-shard", "1/2", "--circuits-shard-out", "p.json"
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["ERROR --circuits-shard 1/2: no part written to p.json (test_knockout_shard failed or did not run)"]
    )
    assert not (pytester.path / "p.json").exists()


def _settings(**raw) -> object:
    base = {"model": "tiny-induction", "builds": "fp32", "probe-n": 4, "probe-length": 16}
    return build_settings({**base, **raw}, baselines=Path("baselines"), front_end="pytest")


def test_pytest_shard_options_are_checked_in_one_line():
    for raw, said in (
        ({"shard": "1/2"}, "--circuits-shard 1/2 needs --circuits-shard-out FILE"),
        ({"shard-out": "p.json"}, "--circuits-shard-out writes a shard job's part: give --circuits-shard I/K too"),
        ({"shard": "1/2", "shard-out": "p", "shard-parts": "x"}, "two jobs; give one"),
        ({"shard": "1/2", "shard-out": "p", "update": True}, "record baselines where the parts merge"),
        ({"shard": "1/2", "shard-out": "p", "builds": "fp32,bf16"}, "measures one build, got fp32, bf16"),
        ({"shard-parts": "p", "knockout-shards": 2}, "measures no knockout: drop --circuits-knockout-shards"),
    ):
        with pytest.raises(ShardError, match=said):
            check_shard_job(_settings(**raw))
    with pytest.raises(ShardError, match="--circuits-shard 3/2: i must lie in 1..K"):
        _settings(shard="3/2")
    with pytest.raises(
        ShardError, match="--circuits-shard 1/2 and --circuits-knockout-shards 3 split the scan two ways"
    ):
        _settings(shard="1/2", **{"knockout-shards": 3})
    settings = _settings(shard="2/2", **{"shard-out": "p.json"})
    check_shard_job(settings)
    assert settings.shard == (2, 2) and settings.knockout_shards == 2


@needs_embedded
def test_a_shard_job_never_measures_the_whole_scan(pytest_parts):
    """In a shard job every way to the unsharded knockout scan is one line naming the merge."""
    session = Run(_settings(shard="1/2", **{"shard-out": "p.json"}))
    with pytest.raises(ShardError, match="this job measures only knockout shard 1/2 \\(--circuits-shard\\)"):
        session.measured.head_knockout("fp32")


@needs_embedded
def test_the_merge_job_refuses_what_is_not_the_builds_parts_in_one_line(pytest_parts, tmp_path):
    gathered, _ = pytest_parts

    def record(pattern: str, **raw):
        return Run(_settings(**{"shard-parts": pattern}, **raw)).records.record("fp32", knockout=True)

    assert (
        record(str(gathered)).data["heads"] == record(str(gathered / "part-*.json")).data["heads"]
    )  # a folder or a glob
    with pytest.raises(ShardError, match="--circuits-shard-parts .*nothing-\\*.json: no file matches"):
        record(str(tmp_path / "nothing-*.json"))
    with pytest.raises(ShardError, match="holds parts of fp32, not a build gated \\(bf16\\)"):
        Run(_settings(builds="bf16", **{"shard-parts": str(gathered)})).records.record("bf16")
    with pytest.raises(ShardError, match="measured with probe .*'n': 4.*this run asks for .*'n': 8"):
        record(str(gathered), **{"probe-n": 8})
    (tmp_path / "own-text").mkdir()  # parts of the own-text probe, gated by a run of the random one
    for i in (1, 2):
        texted = read_part(gathered / f"part-{i}.json")
        texted["record"]["probe"]["text"] = {"file": "team.txt", "sha256": "a" * 64}
        (tmp_path / "own-text" / f"part-{i}.json").write_text(json.dumps(texted))
    with pytest.raises(ShardError, match="measured with probe .*'text': \\{'file': 'team.txt'"):
        record(str(tmp_path / "own-text"))
    (tmp_path / "renamed").mkdir()
    for i in (1, 2):
        renamed = read_part(gathered / f"part-{i}.json")
        renamed["record"]["model"]["name"] = "another-model"
        (tmp_path / "renamed" / f"part-{i}.json").write_text(json.dumps(renamed))
    with pytest.raises(ShardError, match="the parts are of model another-model, this run gates tiny-induction"):
        record(str(tmp_path / "renamed"))
    other = read_part(gathered / "part-2.json")
    other["record"]["model"]["fingerprint"] = "sha256:" + "0" * 64
    (tmp_path / "mixed").mkdir()
    shutil.copy(gathered / "part-1.json", tmp_path / "mixed")
    (tmp_path / "mixed" / "part-2.json").write_text(json.dumps(other))
    with pytest.raises(ShardError, match="part-2.json differs from .*part-1.json in model.fingerprint") as refused:
        record(str(tmp_path / "mixed"))
    assert len(str(refused.value).splitlines()) == 1


@needs_embedded
def test_a_merge_job_needs_no_memory_for_a_probe_it_does_not_run(monkeypatch):
    """The merge job's preflight reads the config and tokenizer only: no probe-memory refusal."""
    from pytest_circuits.errors import CircuitsError
    from pytest_circuits.rungs import repeat

    monkeypatch.setattr(repeat, "available_memory", lambda device: 0)
    with pytest.raises(CircuitsError, match="the repeat probe with n=4, L=16"):
        Run(_settings()).loaded.preflight()
    assert Run(_settings(**{"shard-parts": "parts"})).loaded.preflight().n_layers == 2


# ---------------------------------------------------------------- issue 38: parts that weaken the record


def _merged_or_refused(parts: list[tuple[str, dict]]) -> dict | None:
    """The merge of ``parts``, or None when it was refused with one `ShardError` line (anything else raises)."""
    try:
        return merge_parts(parts)
    except ShardError as error:
        assert "\n" not in str(error), str(error)
        return None


@needs_embedded
def test_merge_proves_coverage_and_each_parts_own_heads(parts, tmp_path, capsys):
    """Issue 38: a part relabelled 1/1 over every layer, a part claiming a layer another owns, parts
    numbered 0/2 or 3/2 beside 1/2 and 2/2 all merged (exit 0) into a record without layer 0's deltas."""
    one, two = read_part(parts / "part-1.json"), read_part(parts / "part-2.json")

    def edited(part: dict, **meta) -> dict:
        out = copy.deepcopy(part)
        out["part"].update(meta)
        return out

    refusals = [
        ([("b", edited(two, index=1, of=1, layers=[0, 1]))], "b is not the part it says .*no knockout_delta for L0H0"),
        ([("a", one), ("b", edited(two, layers=[0, 1]))], "b is not the part it says .*no knockout_delta for L0H0"),
        ([("a", one), ("b", two), ("c", edited(two, index=0))], "c is not a valid shard part: part.index"),
        ([("a", one), ("b", two), ("c", edited(two, index=3))], "c is not a valid shard part: part.index 3 is above"),
        ([("a", one), ("b", edited(one, index=2))], "a and b both claim layer 0"),
        ([("a", edited(one, layers=[0, 7])), ("b", two)], "a claims layer\\(s\\) 7, the model has 2 layers"),
        ([("a", {"part": {"format": 1, "index": 1, "of": 2}, "record": one["record"]})], "part.layers: Field required"),
        ([("a", edited(one, layers=0)), ("b", two)], "part.layers: Input should be a valid list"),
    ]
    for given, expected in refusals:
        with pytest.raises(ShardError, match=expected):
            merge_parts(given)
    relabelled = tmp_path / "relabelled.json"
    relabelled.write_text(json.dumps(edited(two, index=1, of=1, layers=[0, 1])))
    assert main(["merge", str(relabelled), "-o", str(tmp_path / "m.json")]) == 2
    assert "is not the part it says" in capsys.readouterr().err and not (tmp_path / "m.json").exists()


@needs_embedded
def test_malformed_parts_never_merge_into_a_weaker_record(parts):
    """Property (seeded generator): parts made malformed from the real ones (a field missing, of
    another type, out of range, duplicated, overlapping; one to three flaws) either merge into
    exactly the record the good parts give or are refused in one `ShardError` line; never a traceback."""
    import random

    good = [(f"part-{i}", read_part(parts / f"part-{i}.json")) for i in (1, 2)]
    whole = merge_parts(good)
    rng = random.Random(38)
    junk = [None, True, -1, 0, 3, 2.5, "1", "x", [], [0, 0], [1, 0], {}, {"a": 1}]

    def flaw(parts: list[tuple[str, dict]]) -> None:
        name, part = rng.choice(parts)
        kind = rng.randrange(9)
        if kind == 0:  # a header field missing or of another type / out of range
            key = rng.choice(["format", "index", "of", "layers"])
            if rng.random() < 0.3:
                part["part"].pop(key, None)
            else:
                part["part"][key] = rng.choice(junk)
        elif kind == 1:  # a part duplicated, or the other's header copied
            if rng.random() < 0.5:
                parts.append((name + "-again", copy.deepcopy(part)))
            else:
                part["part"] = copy.deepcopy(rng.choice(parts)[1].get("part"))
        elif kind == 2:  # layers overlapping or relabelled over every layer
            part["part"].update(rng.choice([{"layers": [0, 1]}, {"index": 1, "of": 1, "layers": [0, 1]}]))
        elif kind == 3:  # a head's knockout figure lost or of another type
            row = rng.choice(part["record"]["heads"])
            row["knockout_delta"] = rng.choice([None, "big", [], True])
        elif kind == 4:  # a head of a layer the part does not own given a figure
            row = rng.choice(part["record"]["heads"])
            row["knockout_delta"] = 1.0 if row["knockout_delta"] is None else row["knockout_delta"]
            row["knockout_delta_sequences"] = None
            row["knockout_delta_interval"] = None
        elif kind == 5:  # a record field missing
            part["record"].pop(rng.choice(sorted(part["record"])), None)
        elif kind == 6:  # the part, the record or the whole file of another type
            key = rng.choice(["part", "record"])
            part[key] = rng.choice(junk)
        elif kind == 7:  # a part dropped
            if len(parts) > 1:
                parts.remove((name, part))
        else:  # the knockout info changed (unscreened <-> screened, or gone)
            part["record"]["knockout"] = rng.choice([None, {**part["record"]["knockout"], "screened": "12"}])

    for _ in range(400):
        case = copy.deepcopy(good)
        rng.shuffle(case)
        for _ in range(rng.randint(1, 3)):
            try:
                flaw(case)
            except (AttributeError, TypeError, KeyError, IndexError):
                break  # an earlier flaw made this one meaningless: merge what is there
        merged = _merged_or_refused(case)
        assert merged is None or merged == whole


@needs_embedded
def test_merge_output_is_never_an_input_a_link_or_a_folder(parts, tmp_path, capsys):
    """``merge -o`` naming one of its parts overwrote it (exit 0); a link as ``-o`` or ``record --shard
    --out`` wrote through to any file; a folder among the parts tracebacked. Each is one line, exit 2,
    before any work, and every file is as it was."""
    copies = tmp_path / "parts"
    shutil.copytree(parts, copies)
    before = {p.name: p.read_bytes() for p in copies.iterdir()}
    victim = tmp_path / "victim.txt"
    victim.write_text("VICTIM\n")
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    folder = tmp_path / "folder.json"
    folder.mkdir()
    one, two = str(copies / "part-1.json"), str(copies / "part-2.json")
    cases = [
        (["merge", one, two, "-o", two], f"-o {two} is the part {two}: write the merged record to another file"),
        (["merge", one, two, "-o", str(link)], f"cannot write {link}: it is a symbolic link (to {victim})"),
        (["merge", one, str(folder), "-o", str(tmp_path / "m.json")], f"part {folder} is a folder, not a file"),
        (
            ["record", "tiny-induction", "--build", "fp32", "--shard", "1/2", "--out", str(link), *PROBE],
            f"cannot write {link}: it is a symbolic link",
        ),
    ]
    for argv, expected in cases:
        assert main(argv) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and captured.out == "", captured.err
    assert {p.name: p.read_bytes() for p in copies.iterdir()} == before
    assert victim.read_text() == "VICTIM\n" and link.is_symlink() and not (tmp_path / "m.json").exists()


@needs_embedded
def test_the_merge_job_validates_its_parts_as_circuits_merge_does(parts, tmp_path):
    """``--circuits-shard-parts`` reads the parts through the same checks: a relabelled part is one line."""
    relabelled = read_part(parts / "part-2.json")
    relabelled["part"].update(index=1, of=1, layers=[0, 1])
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "part-1.json").write_text(json.dumps(relabelled))
    session = Run(_settings(**{"shard-parts": str(tmp_path / "parts")}))
    with pytest.raises(ShardError, match="part-1.json is not the part it says .*no knockout_delta for L0H0"):
        session.records.record("fp32", knockout=True)


@needs_embedded
def test_a_gate_against_a_record_that_lost_key_heads_deltas_fails_naming_them(whole):
    """The record a bad merge wrote had no delta for layer 0's heads (key head L0H1 among them): the gate
    compared 1 key head instead of 4 and passed. A record whose unscreened scan lost deltas fails."""
    from pytest_circuits.gate.invariants import evaluate
    from pytest_circuits.gate.tolerances import Tolerances

    record = json.loads((whole / "tiny-induction--fp32.json").read_text())
    weak = copy.deepcopy(record)
    for row in weak["heads"]:
        if row["layer"] == 0:
            row.update(knockout_delta=None, knockout_delta_sequences=None, knockout_delta_interval=None)
    result = evaluate("knockout_deltas", weak, record, Tolerances(), "fp32", "baseline")
    assert result.status == "failed"
    assert "holds no knockout_delta for 4 head(s) (L0H0, L0H1, L0H2, L0H3)" in result.message
    assert evaluate("knockout_deltas", record, record, Tolerances(), "fp32", "baseline").status == "passed"
