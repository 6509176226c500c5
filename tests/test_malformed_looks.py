"""A baseline's further looks (the sequential rule's fresh sequences) are read as typed, checked
values: each malformed form is refused in one line naming the file, the look and the fix, never
gated on mispaired or missing sequences (which turned a FAIL into a PASS, #50)."""

from __future__ import annotations

import copy
import json

import pytest

from pytest_circuits.cli import main
from pytest_circuits.errors import BaselineError
from pytest_circuits.record.seeds import look_seed
from pytest_circuits.record.store import read_record

from .conftest import SHIPPED_BASELINES, beyond_progress

SHIPPED = SHIPPED_BASELINES / "tiny-induction--fp32.json"


def _values(k: int, key: str, values):
    def mutate(record):
        record["looks"][k - 2][key] = values(record["looks"][k - 2][key])

    return mutate


def _drop_look(k: int):
    def mutate(record):
        del record["looks"][k - 2]

    return mutate


def _renumber(k: int, number):
    def mutate(record):
        record["looks"][k - 2]["look"] = number

    return mutate


def _seed(k: int, key: str, seed):
    def mutate(record):
        record["looks"][k - 2][key] = seed(record)

    return mutate


def _swap_seeds(record):
    a, b = record["looks"][0], record["looks"][1]
    a["probe_seed"], b["probe_seed"] = b["probe_seed"], a["probe_seed"]


def _duplicate_look(record):
    record["looks"][1] = {**copy.deepcopy(record["looks"][0]), "look": 3}


def _knockout_head(record):
    deltas = record["looks"][0]["knockout_delta_sequences"]
    deltas["L1H3"] = deltas.pop(sorted(deltas)[0])


def _misspelt(record):
    record["looks"][0]["copy_loss_sequence"] = record["looks"][0].pop("copy_loss_sequences")


def _knockout_as_list(record):
    record["looks"][0]["knockout_delta_sequences"] = [0.1] * 8


MALFORMED = [  # (case, mutation of the shipped fp32 baseline, what the one line says)
    (
        "4 values of n 8",
        _values(3, "copy_loss_sequences", lambda v: v[:4]),
        "(look 3).copy_loss_sequences holds 4 values but the probe has n=8",
    ),
    (
        "16 values of n 8",
        _values(2, "copy_loss_sequences", lambda v: v + v),
        "(look 2).copy_loss_sequences holds 16 values",
    ),
    ("looks 2 and 4", _drop_look(3), "looks are numbered [2, 4]"),
    ("looks 2, 3, 3", _renumber(4, 3), "looks are numbered [2, 3, 3]"),
    ("look 1 stored", _renumber(2, 1), "looks[0].look: Input should be greater than or equal to 2"),
    (
        "NaN",
        _values(3, "copy_gain_sequences", lambda v: [float("nan"), *v[1:]]),
        "looks[1].copy_gain_sequences[0]: Input should be a finite number",
    ),
    (
        "a string",
        _values(2, "copy_loss_sequences", lambda v: ["0.1", *v[1:]]),
        "looks[0].copy_loss_sequences[0]: Input should be a valid number",
    ),
    ("duplicated look", _duplicate_look, "(look 3).probe_seed is"),
    ("swapped seeds", _swap_seeds, "(look 2).probe_seed is"),
    (
        "mismatched seed",
        _seed(4, "knockout_seed", lambda r: look_seed(r["knockout"]["seed"], 4) + 1),
        "(look 4).knockout_seed is",
    ),
    (
        "negative seed",
        _seed(2, "probe_seed", lambda r: -1),
        "looks[0].probe_seed: Input should be greater than or equal to 0",
    ),
    ("no seed", _seed(2, "probe_seed", lambda r: None), "looks[0].probe_seed: Input should be a valid integer"),
    (
        "knockout look a list",
        _knockout_as_list,
        "looks[0].knockout_delta_sequences: Input should be a valid dictionary",
    ),
    ("knockout of other heads", _knockout_head, "(look 3).knockout_delta_sequences names heads"),
    (
        "knockout of n 4",
        _values(2, "knockout_delta_sequences", lambda d: {h: v[:4] for h, v in d.items()}),
        "holds 4 values but the knockout has n=8",
    ),
    (
        "a figure missing",
        _values(3, "first_copy_loss_sequences", lambda v: None),
        "(look 3) holds copy_loss_sequences, copy_gain_sequences, knockout_delta_sequences, look 2",
    ),
    ("a misspelt key", _misspelt, "looks[0].copy_loss_sequence: Extra inputs are not permitted"),
    (
        "a look without one head",  # a build's look may drop decided heads in a gate; a stored one may not
        _values(4, "knockout_delta_sequences", lambda d: {h: v for h, v in sorted(d.items())[1:]}),
        "(look 4) knocks out 3 head(s), look 2 4 (L0H1 missing)",
    ),
]


def _write(tmp_path, mutate):
    record = json.loads(SHIPPED.read_text())
    mutate(record)
    path = tmp_path / "tiny-induction--fp32.json"
    path.write_text(json.dumps(record))
    return path


@pytest.mark.parametrize("case, mutate, expected", MALFORMED, ids=[c for c, _, _ in MALFORMED])
def test_malformed_looks_are_refused_in_one_line(tmp_path, case, mutate, expected):
    path = _write(tmp_path, mutate)
    with pytest.raises(BaselineError) as raised:
        read_record(path)
    line = str(raised.value)
    assert "\n" not in line and expected in line, line
    assert str(path) in line and "record it again" in line


def test_the_shipped_baselines_looks_are_well_formed():
    """Every shipped baseline passes the checks above (they hold 3 further looks each)."""
    for path in sorted(SHIPPED_BASELINES.glob("*.json")):
        assert [entry.look for entry in read_record(path).looks or []] == [2, 3, 4], path.name


def test_a_malformed_look_no_longer_turns_the_fail_into_a_pass(tmp_path, capsys):
    """The issue's command: rtn-int4 fails copy_loss at 0.03 on look 4 against the intact baseline; the
    same baseline with look 3 cut to 4 values passed on look 1 by the fixed rule. Now: exit 2, one line."""
    argv = ["gate", "tiny-induction", "--build", "rtn-int4", "--no-knockout", "--tol", "copy_loss=0.03"]
    assert main([*argv, "--baseline", str(SHIPPED)]) == 1
    out = capsys.readouterr().out
    assert "FAIL copy_loss" in out and "(look 4 of 4)" in out
    bad = _write(tmp_path, MALFORMED[0][1])
    assert main([*argv, "--baseline", str(bad)]) == 2
    captured = capsys.readouterr()
    assert "gate passed" not in captured.out and "PASS copy_loss" not in captured.out
    lines = [line for line in beyond_progress(captured.err) if line.strip()]
    assert len(lines) == 1 and "(look 3).copy_loss_sequences holds 4 values" in lines[0]
