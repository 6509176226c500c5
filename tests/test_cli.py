"""The ``circuits`` command through its entry point: scan, record, gate, diff, errors."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from pytest_circuits.cli import main
from pytest_circuits.testing import make_tiny_model, negate_head_ov, save_tiny_model

SMALL = ["--device", "cpu", "--probe-n", "4", "--probe-length", "16"]
SCAN_HEAD_KEYS = {
    "head",
    "layer",
    "head_index",
    "kappa",
    "kappa_trace",
    "kappa_z",
    "kappa_q",
    "copying",
    "suppression",
    "prefix_matching",
    "previous_token",
    "duplicate_token",
    "knockout_delta",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model("gpt2", tmp_path_factory.mktemp("cli") / "m", seed=0)


@pytest.fixture(scope="module")
def recorded(model, tmp_path_factory):
    baselines = tmp_path_factory.mktemp("baselines")
    assert main(["record", str(model), "--build", "fp32,rtn-int8", "--baselines", str(baselines), *SMALL]) == 0
    return baselines


def test_help_through_the_console_script():
    exe = shutil.which("circuits")
    command = [exe] if exe else [sys.executable, "-m", "pytest_circuits.cli"]
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for sub in ("scan", "record", "gate", "diff"):
        assert sub in done.stdout


def test_help_states_each_default_once_and_names_this_commands_flags(capsys):
    """``circuits record --help`` gave --baselines two defaults; --device-map named --circuits-device."""
    for command in ("scan", "record", "gate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        entries = [" ".join(entry.split()) for entry in text.split("\n  -")[1:]]
        assert [e for e in entries if e.count("(default:") > 1] == []
        assert "--circuits-" not in text
    with pytest.raises(SystemExit):
        main(["scan", "--help"])
    assert "none: the whole model on --device" in " ".join(capsys.readouterr().out.split())


def test_report_help_imports_no_torch():
    """``circuits report --help`` took 7 s: the report's imports (torch) ran before argparse."""
    code = (
        "import sys\n"
        "from pytest_circuits.cli import main\n"
        "try:\n"
        "    main(['report', '--help'])\n"
        "except SystemExit as done:\n"
        "    print('exit', done.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "usage: circuits report" in done.stdout and done.stdout.splitlines()[-1] == "exit 0 False"


def test_model_imports_print_nothing_on_the_commands_stderr():
    """With the ``formats`` extra, loading a model imports torchao (transformers' quantizer table),
    which logged its CUDA kernels' load failures and a torch pytree deprecation on every command."""
    code = (
        "from pytest_circuits.cli import _quiet_imports\n"
        "_quiet_imports()\n"
        "import transformers.modeling_utils\n"
        "from transformers import AutoModelForCausalLM\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""


def test_scan_json_holds_the_contract(model, tmp_path, capsys):
    out = tmp_path / "scan.json"
    assert main(["scan", str(model), "--json", str(out), *SMALL]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["model"]["name"] == "m" and record["build"]["recipe"] == "fp32"
    assert record["probe"]["n"] == 4 and record["probe"]["L"] == 16
    for key in ("copy_loss", "first_copy_loss", "copy_gain"):
        assert math.isfinite(record[key])
    assert record["copy_gain"] == pytest.approx(record["first_copy_loss"] - record["copy_loss"], abs=2e-5)
    assert len(record["heads"]) == 8 and SCAN_HEAD_KEYS <= set(record["heads"][0])
    assert all(h["knockout_delta"] is not None for h in record["heads"])
    for h in record["heads"]:  # the printed table shows every head with its kappa
        assert f"{h['head']} " in printed and f"{h['kappa']:+.3f}" in printed


def test_scan_without_knockout(model, tmp_path):
    out = tmp_path / "scan.json"
    assert main(["scan", str(model), "--json", str(out), "--no-knockout", *SMALL]) == 0
    assert all(h["knockout_delta"] is None for h in json.loads(out.read_text())["heads"])


def test_record_then_gate_passes(model, recorded, capsys):
    assert sorted(p.name for p in recorded.iterdir()) == ["m--fp32.json", "m--rtn-int8.json"]
    code = main(
        ["gate", str(model), "--build", "rtn-int8", "--baseline", str(recorded / "m--fp32.json"), "--device", "cpu"]
    )  # probe settings come from the baseline
    out = capsys.readouterr().out
    assert code == 0, out
    assert "gate passed" in out and "weights differ" not in out


def test_gate_fails_on_a_negated_head(recorded, tmp_path, capsys):
    record = json.loads((recorded / "m--fp32.json").read_text())
    target = max(record["heads"], key=lambda h: abs(h["kappa_trace"]))
    model = make_tiny_model("gpt2", seed=0)
    negate_head_ov(model, target["layer"], target["head_index"])
    folder = tmp_path / "m"
    model.save_pretrained(folder, safe_serialization=True)
    code = main(
        ["gate", str(folder), "--build", "fp32", "--baseline", str(recorded / "m--fp32.json"), "--device", "cpu"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL copying_heads" in out and f"{target['head']} " in out and "weights differ" in out
    assert f"circuits record {folder} --build fp32 --baselines {recorded}" in out
    # a loose tolerance lets the same change through
    assert (
        main(
            [
                "gate",
                str(folder),
                "--build",
                "fp32",
                "--baseline",
                str(recorded / "m--fp32.json"),
                "--device",
                "cpu",
                "--tol",
                "kappa=2",
                "--tol",
                "rank=-1",
            ]
        )
        == 0
    )


def test_the_gate_hint_rerecords_the_file_it_gated_against(recorded, tmp_path, capsys):
    """Pasted, the hint of a failed `circuits gate` rewrites that very baseline file, and the gate passes."""
    import re
    import shlex

    baselines = tmp_path / "kept"
    baselines.mkdir()
    (baselines / "m--fp32.json").write_bytes((recorded / "m--fp32.json").read_bytes())
    record = json.loads((recorded / "m--fp32.json").read_text())
    target = max(record["heads"], key=lambda h: abs(h["kappa_trace"]))
    model = make_tiny_model("gpt2", seed=0)
    negate_head_ov(model, target["layer"], target["head_index"])
    folder = tmp_path / "renamed"  # another folder name: the hint must keep the baseline's own name
    model.save_pretrained(folder, safe_serialization=True)
    gate = ["gate", str(folder), "--build", "fp32", "--baseline", str(baselines / "m--fp32.json"), *SMALL]
    assert main(gate) == 1
    hint = shlex.split(re.search(r"record the baseline again: (circuits record .*)", capsys.readouterr().out).group(1))
    assert main(hint[1:]) == 0
    assert sorted(p.name for p in baselines.iterdir()) == ["m--fp32.json"]
    assert main(gate) == 0


def test_diff_lists_what_moved(recorded, tmp_path, capsys):
    a = json.loads((recorded / "m--fp32.json").read_text())
    b = json.loads((recorded / "m--fp32.json").read_text())
    b["heads"][5]["kappa"] = a["heads"][5]["kappa"] + 0.5
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["diff", str(recorded / "m--fp32.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("L")]
    assert len(rows) == 1 and rows[0].split()[:2] == [a["heads"][5]["head"], "kappa"]
    assert "+0.5000" in rows[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["scan", "/no/such/model"], "not found"),
        (["scan", "MODEL", "--build", "fp64"], "unknown build recipe 'fp64'"),
        (["gate", "MODEL", "--build", "fp32", "--baseline", "/no/such.json"], "does not exist"),
        (["gate", "MODEL", "--build", "fp32", "--baseline", "BASELINE", "--tol", "kappa"], "NAME=VALUE"),
        (["diff", "BASELINE", "/no/such.json"], "does not exist"),
    ],
)
def test_input_errors_are_one_line_exit_2(model, recorded, capsys, argv, expected):
    argv = [str(model) if a == "MODEL" else str(recorded / "m--fp32.json") if a == "BASELINE" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err


def test_corrupt_baseline_exit_2(model, tmp_path, capsys):
    bad = tmp_path / "m--fp32.json"
    bad.write_text('{"schema_version": 7}')
    assert main(["gate", str(model), "--build", "fp32", "--baseline", str(bad)]) == 2
    assert "schema version 7" in capsys.readouterr().err


def test_incomplete_baseline_is_refused_in_one_line_naming_the_file_and_the_fix(model, recorded, tmp_path, capsys):
    """A baseline missing a figure the typed record requires is refused where it is read, before any
    invariant: one line naming the file, the field and the fix (typed records, issue #39 item 4)."""
    import json

    record = json.loads((recorded / "m--fp32.json").read_text())
    del record["copy_loss"]
    bad = tmp_path / "m--fp32.json"
    bad.write_text(json.dumps(record))
    assert main(["gate", str(model), "--build", "fp32", "--baseline", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(bad) in err and "copy_loss" in err and "record" in err.split(";")[-1]


def test_usage_error_exit_2():
    with pytest.raises(SystemExit) as done:
        main(["record", "m"])  # --build is required
    assert done.value.code == 2


def test_head_table_shows_each_heads_ov_gain_against_the_largest():
    from pytest_circuits.show import head_table

    from .scan_records import typed

    heads = [
        {"head": f"L{layer}H{head}", "layer": layer, "head_index": head, "kappa": 0.5, "ov_gain": gain}
        for layer, head, gain in ((0, 0, 8.0), (0, 1, 2.0), (1, 0, 0.04), (1, 1, 1.0))
    ]
    lines = head_table(typed({"heads": heads}, n_layers=2, n_heads=2)).splitlines()
    assert lines[0].split()[-3:] == ["ov", "gain", "flag"]
    assert [line.split()[-1] for line in lines[1:]] == ["1.000", "0.250", "0.005", "0.125"]
    no_gain = head_table(typed({"heads": [{"head": "L0H0", "kappa": 0.5}]}))
    assert "ov gain" not in no_gain  # records without gains or eigenvalues: no column


def test_diff_rows_stay_aligned_for_the_longest_metric_name(capsys):
    """``kappa_trace_uncentred`` (21 characters) pushed its row's numbers out of their columns."""

    from .conftest import SHIPPED_BASELINES as shipped

    a, b = shipped / "tiny-induction--fp32.json", shipped / "tiny-induction--rtn-int4.json"
    assert main(["diff", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith("head ") or line[:1] == "L" and line[1:2].isdigit()]
    assert any("kappa_trace_uncentred" in line for line in table)
    assert len({len(line) for line in table}) == 1  # every column right-aligned to one width


def test_model_line_names_the_model_type_and_its_layout():
    """A Qwen3 record says qwen3 (its model type) and llama (the layout its heads are read with),
    not "llama" alone; an older record without a model type keeps the layout's name."""
    from pytest_circuits.record.schema import Record
    from pytest_circuits.show import model_lines

    from .scan_records import complete

    heads = [{"head": f"L{l}H{h}", "layer": l, "head_index": h} for l in range(2) for h in range(4)]
    record = complete({"model": {"name": "q", "family": "llama", "model_type": "qwen3"}, "heads": heads})
    assert model_lines(Record.of(record))[0].startswith("model q (qwen3, llama layout, 2 layers x 4 heads)")
    record["model"]["model_type"] = "llama"
    assert model_lines(Record.of(record))[0].startswith("model q (llama, 2 layers x 4 heads)")
    del record["model"]["model_type"]
    assert model_lines(Record.of(record))[0].startswith("model q (llama, 2 layers x 4 heads)")


# ---------------------------------------------------------------- the help shows the build syntax and exit codes (#54)

# The issue's list: the 13 recipes the CLI knew when `circuits gate --help` named none of them.
RECIPES_OF_ISSUE_54 = (
    "fp32 bf16 fp16 bnb-int8 bnb-nf4 bnb-fp4 rtn-int8 rtn-int4 fp8-e4m3 fp8-e4m3-dyn int8-w8a8 gptq-int4 awq-int4"
).split()


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["scan", "record", "gate", "sensitivity"])
def test_a_commands_help_shows_the_build_syntax_and_the_exit_codes(capsys, command):
    text = _help(capsys, command)
    builds = text.split("\nbuilds (")[1].split("\nexit status:")[0]
    listed = [line.split()[0] for line in builds.splitlines()[1:] if line.startswith("  ") and line[2] != " "]
    for recipe in RECIPES_OF_ISSUE_54:
        assert recipe in listed, f"circuits {command} --help lists no recipe {recipe}"
    assert "NAME=PATH" in listed and "BUILD+kv-FORMAT[-dyn][-rN]" in listed
    assert "q4_0" in builds and "-rN: the last N tokens" in " ".join(builds.split())
    codes = [line.split()[0] for line in text.split("\nexit status:\n")[1].splitlines()]
    assert codes == ["0", "1", "2", "130"]


def test_the_top_level_and_diff_help_list_every_exit_code(capsys):
    for argv in ([], ["diff"]):
        text = _help(capsys, *argv)
        status = text.split("\nexit status:\n")[1]
        assert "1    an invariant broke" in status and "2    a usage or input error" in status and "130" in status
        assert "\nbuilds (" not in text  # no build to type


def test_pytest_and_the_cli_say_the_build_syntax_from_one_table(capsys):
    """pytest's --circuits-builds help and `circuits gate --help` name the same recipes and KV formats."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--help"], capture_output=True, text=True, timeout=120)
    pytest_help = " ".join(done.stdout.split("--circuits-builds=")[1].split("--circuits-reference")[0].split())
    cli_help = " ".join(_help(capsys, "gate").split("\nbuilds (")[1].split())
    for word in [*RECIPES_OF_ISSUE_54, "+kv-FORMAT[-dyn][-rN]", "iq4_nl", "hqq-int2", "NAME=PATH"]:
        assert word in pytest_help and word in cli_help, word
