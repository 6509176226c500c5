"""Issue 42, a new user's first hour: shipped baselines by name, the default baselines folder, hints
that paste, and a gate run without knockouts saying what it did not check."""

from __future__ import annotations

import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_circuits.cli import build_parser, main
from pytest_circuits.record.store import baseline_file, read_baseline, shipped_baselines
from pytest_circuits.testing import requires_embedded_model

from .conftest import SHIPPED_BASELINES

# ---------------------------------------------------------------- shipped baselines by name


def test_circuits_baselines_lists_every_shipped_file_with_its_path(capsys):
    assert main(["baselines"]) == 0
    out = capsys.readouterr().out
    files = sorted(SHIPPED_BASELINES.glob("*.json"))
    assert files and len(shipped_baselines()) == len(files)
    for path in files:
        assert f"{path.stem}  " in out and str(path) in out, path.name
    assert "--baseline tiny-induction--fp32" in out  # how to use one


def test_a_shipped_baseline_resolves_by_name_in_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = SHIPPED_BASELINES / "tiny-induction--fp32.json"
    assert baseline_file("tiny-induction--fp32") == shipped
    assert baseline_file("tiny-induction--fp32.json") == shipped
    assert read_baseline(baseline_file("tiny-induction--fp32"))["build"]["recipe"] == "fp32"
    # a path with a folder, or a name the package does not ship, is taken as typed
    assert baseline_file("baselines/tiny-induction--fp32.json") == Path("baselines/tiny-induction--fp32.json")
    assert baseline_file("no-such--fp32") == Path("no-such--fp32")
    # a file of that name in the working folder comes first
    (tmp_path / "tiny-induction--fp32.json").write_text("{}")
    assert baseline_file("tiny-induction--fp32.json") == Path("tiny-induction--fp32.json")


@requires_embedded_model()
@pytest.mark.slow
def test_gate_against_a_shipped_baseline_by_name_from_an_empty_folder(tmp_path, monkeypatch, capsys):
    """The README's `circuits gate` line, outside a clone (about 8 s)."""
    monkeypatch.chdir(tmp_path)
    assert main(["gate", "tiny-induction", "--build", "rtn-int8", "--baseline", "tiny-induction--fp32"]) == 0
    out = capsys.readouterr().out
    assert "against the baseline tiny-induction--fp32.json" in out and "gate passed (6 of 6" in out
    assert not list(tmp_path.iterdir())  # nothing written where it ran


# ---------------------------------------------------------------- the default baselines folder


def test_the_default_baselines_folder_is_beside_the_ini_file_else_where_pytest_started(tmp_path):
    """Without an ini file, pytest's rootdir under --pyargs is the common parent of the working folder
    and site-packages (issue 42): the default is the folder pytest was started in instead."""
    from pytest_circuits.plugin import default_baselines

    started, project = tmp_path / "work", tmp_path / "project"
    no_ini = SimpleNamespace(rootpath=tmp_path, inipath=None, invocation_params=SimpleNamespace(dir=started))
    assert default_baselines(no_ini) == started / "baselines"
    ini = SimpleNamespace(
        rootpath=project, inipath=project / "pytest.ini", invocation_params=SimpleNamespace(dir=started)
    )
    assert default_baselines(ini) == project / "baselines"


# ---------------------------------------------------------------- hints that paste


def test_gates_missing_baseline_hint_is_the_complete_record_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["gate", "tiny-induction", "--build", "rtn-int8", "--baseline", "baselines/tiny-induction--fp32.json"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    command = err.split("record it with: ", 1)[1].split(";", 1)[0].strip()
    words = shlex.split(command)
    assert words[:2] == ["circuits", "record"]
    args = build_parser().parse_args(words[1:])  # it parses as given
    assert (args.model, args.build, str(args.baselines), args.name) == (
        "tiny-induction",
        "fp32",
        "baselines",
        "tiny-induction",
    )
    assert "--baseline tiny-induction--fp32" in err  # and the shipped one of that name is offered


def test_a_missing_baseline_of_another_name_says_where_recording_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["gate", "tiny-induction", "--build", "fp32", "--baseline", "refs/mine.json"]) == 2
    err = capsys.readouterr().err
    assert "record one with: circuits record tiny-induction --build fp32 --baselines refs" in err
    assert "circuits baselines lists them" in err


def test_a_gate_failure_against_a_shipped_baseline_records_into_the_working_folder():
    """Never a command that would write into the package: the shipped file's name, ./baselines."""
    from pytest_circuits.gate.fixes import file_record_command
    from pytest_circuits.settings import CircuitsSettings

    command = file_record_command(
        CircuitsSettings(model="./m"), "fp32", SHIPPED_BASELINES / "tiny-induction--fp32.json"
    )
    assert " --baselines baselines " in command and "--name tiny-induction" in command
    assert str(SHIPPED_BASELINES) not in command


def test_an_unsupported_model_type_points_to_the_entry_point_first():
    from pytest_circuits.model.family_resolution import _unsupported_line

    line = _unsupported_line("openai-gpt")
    assert "\n" not in line
    assert 'project.entry-points."pytest_circuits.families"' in line and "pyproject.toml" in line
    assert line.index("pytest_circuits.families") < line.index("family_table.py")
    assert "in a clone" in line  # the table is edited in a clone, never in site-packages


# ---------------------------------------------------------------- what a gate did not check


def test_a_record_without_knockouts_skips_knockout_deltas_by_name():
    """``circuits gate --no-knockout`` and ``circuits report --against`` a scan without knockouts:
    knockout_deltas is skipped saying why, and the verdict calls it not guarded (it printed
    "gate passed (5 of 5 invariants hold)")."""
    import copy

    from pytest_circuits.gate.invariants import gate_all, verdict
    from pytest_circuits.gate.tolerances import Tolerances

    baseline = read_baseline(SHIPPED_BASELINES / "tiny-induction--fp32.json")
    candidate = copy.deepcopy(baseline)
    for head in candidate["heads"]:
        head["knockout_delta"] = None
    results = gate_all(baseline, candidate, Tolerances(), "fp32", "baseline tiny-induction--fp32.json")
    skipped = [r for r in results if r.skipped]
    assert [r.invariant for r in skipped] == ["knockout_deltas"]
    assert "not checked" in skipped[0].message and "knockout" in skipped[0].message
    passed, line = verdict(results)
    assert passed and "1 skipped (knockout_deltas)" in line and "NOT guarded" in line
    full = gate_all(baseline, baseline, Tolerances(), "fp32", "baseline tiny-induction--fp32.json")
    assert not any(r.skipped for r in full) and len(full) == len(results)


def test_gate_and_scan_share_one_no_knockout_option():
    parser = build_parser()
    argv = {"scan": ["scan", "m"], "gate": ["gate", "m", "--build", "fp32", "--baseline", "b"]}
    helps = {}
    for command, words in argv.items():
        assert parser.parse_args([*words, "--no-knockout"]).no_knockout
        assert not parser.parse_args(words).no_knockout
        sub = parser._subparsers._group_actions[0].choices[command]
        (action,) = [a for a in sub._actions if "--no-knockout" in a.option_strings]
        helps[command] = action.help
    assert helps["gate"].startswith(helps["scan"]) and "knockout_deltas is not checked" in helps["gate"]


# ---------------------------------------------------------------- the command line: version, "did you mean"


def test_circuits_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert (
        capsys.readouterr().out.strip() == f"circuits (pytest-circuits) {importlib.metadata.version('pytest-circuits')}"
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["gat", "m"], "(did you mean 'gate'?)"),
        (["gate", "m", "--build", "fp32", "--baseline", "b", "--no-knockot"], "(did you mean '--no-knockout'?)"),
        (["scan", "m", "--probe-lenght", "16"], "(did you mean '--probe-length'?)"),
    ],
)
def test_a_mistyped_command_or_option_gets_a_did_you_mean(argv, expected, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--tol", "kapa=0.1"], "unknown tolerance(s) kapa (did you mean 'kappa'?); known: kappa,"),
        (["--build", "rtn-int9"], "unknown build recipe 'rtn-int9' (did you mean 'rtn-int8'?); known recipes:"),
        (["--knockout-mode", "zer"], "got 'zer' (did you mean 'zero'?)"),
    ],
)
def test_a_mistyped_value_gets_a_did_you_mean_before_the_list(argv, expected, tmp_path, monkeypatch, capsys):
    """One line, exit 2, before any model is loaded."""
    monkeypatch.chdir(tmp_path)
    base = ["gate", "tiny-induction", "--build", "fp32", "--baseline", "tiny-induction--fp32"]
    words = base[:2] + argv + (base[2:] if argv[0] != "--build" else base[4:])
    assert main(words) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


def test_a_word_far_from_every_choice_gets_no_guess():
    from pytest_circuits.errors import did_you_mean

    assert did_you_mean("kapa", ["kappa", "rank"]) == " (did you mean 'kappa'?)"
    assert did_you_mean("zzzz", ["kappa", "rank"]) == ""


# ---------------------------------------------------------------- docs that agree with the code

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_page_states_a_family_count_other_than_the_tables():
    import re

    from pytest_circuits.model.family_resolution import supported_model_types

    count = len(supported_model_types())
    for page in PAGES:
        for said in re.findall(r"\b(\d+) (?:decoder |model )?families\b", page.read_text(encoding="utf-8")):
            assert int(said) == count, f"{page.name} says {said} families, the table has {count}"


def test_no_page_names_a_folder_of_the_machine_it_was_measured_on():
    import re

    for page in PAGES:
        found = re.findall(r"(?:/work|/home|/root|/Users)/\S+", page.read_text(encoding="utf-8"))
        assert not found, f"{page.name}: {found[:3]}"


def test_the_loss_caption_says_what_the_first_copys_loss_is():
    """Not "near the uniform ln V": a trained LM sits well above it (SmolLM2-135M near 14, ln V 10.8)."""
    from pytest_circuits.report.sections import LOSS_CAPTION

    assert "cannot predict" in LOSS_CAPTION and "stays near the uniform" not in LOSS_CAPTION


def test_the_first_gguf_conversion_beats_while_it_runs(tmp_path, monkeypatch, capsys):
    """SmolLM2's first run converted its GGUF for about 30 s without a line (issue 42)."""
    import time

    import pytest_circuits.progress as progress
    from pytest_circuits.model.gguf_cache import _cached_conversion

    class SlowConvert:
        path, key = Path("model.gguf"), "k" * 64

        def model(self):
            time.sleep(0.3)

        def save(self, folder: Path) -> None:
            (folder / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(progress, "INTERVAL", 0.05)
    folder = _cached_conversion(tmp_path / "gguf", SlowConvert())
    assert (folder / "model.safetensors").is_file()
    err = capsys.readouterr().err.splitlines()
    beats = [line for line in err if line.startswith("converting model.gguf to float32 safetensors, once")]
    assert len(beats) >= 3 and beats[-1].endswith("done in 0s")
