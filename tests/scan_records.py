"""Hand-built scan records made whole: the gate reads validated `schema.Record`s, so a test that
builds a record from the few figures it is about fills in the rest here (`complete`)."""

from __future__ import annotations

import copy
import math

from pytest_circuits.record import figures
from pytest_circuits.record.schema import Record
from pytest_circuits.record.seeds import look_seed


def _filler(figure: figures.Figure):
    """A neutral value of a figure the test did not set: None where the schema allows it, else a
    value within its range (0 where 0 is in it)."""
    if figure.nullable or figure.stored == "measured":
        return None
    if figure.kind == "bool":
        return False
    if figure.kind == "str":
        return ""
    value = 0.0 if figure.kind == "float" else 0
    if figure.low is not None and value < figure.low:
        value = figure.low
    if figure.high is not None and value > figure.high:
        value = figure.high
    return value


def complete(partial: dict, n_layers: int | None = None, n_heads: int | None = None) -> dict:
    """``partial`` (a record dict holding some figures) with every field the schema requires: the
    model (geometry from its head labels unless given), build, probe and model figures, and each
    head row's figures the test left out. What the test set is kept as it is."""
    record = copy.deepcopy(partial)
    heads = record.setdefault("heads", [])
    if not heads:  # a record about model figures only: one layer of one head
        heads.append({"head": "L0H0", "layer": 0, "head_index": 0})
    for row in heads:
        for figure in figures.HEAD_FIGURES:
            if figure.stored == "always" and figure.name not in row:
                row[figure.name] = _filler(figure)
    layers = n_layers or 1 + max(row["layer"] for row in heads)
    per_layer = n_heads or 1 + max(row["head_index"] for row in heads)
    model = record.setdefault("model", {})
    model.setdefault("name", "hand-built")
    model.setdefault("spec", "hand-built")
    model.setdefault("family", "llama")
    geometry = model.setdefault("geometry", {})
    geometry.setdefault("n_layers", layers)
    geometry.setdefault("n_heads", per_layer)
    geometry.setdefault("n_kv_heads", geometry["n_heads"])
    geometry.setdefault("d_head", 8)
    geometry.setdefault("d_model", geometry["d_head"] * geometry["n_heads"])
    geometry.setdefault("vocab", 100)
    record.setdefault("schema_version", 1)
    record.setdefault(
        "build", {"recipe": "fp32", "dtype": "float32", "backend": "torch", "backend_version": "0", "device": "cpu"}
    )
    n = len(record.get(figures.sequences_key("copy_loss")) or [None] * 8)  # one value per probe sequence
    record.setdefault("probe", {"seed": 0, "n": n, "L": 64})
    record.setdefault("copy_loss", 0.5)
    record.setdefault("first_copy_loss", record["copy_loss"] + 4.0)
    record.setdefault("copy_gain", record["first_copy_loss"] - record["copy_loss"])
    record.setdefault("uniform_loss", math.log(geometry["vocab"]))
    knockout_seed = (record.get("knockout") or {}).get("seed", 0)
    for entry in record.get("looks") or []:  # seeded as the rule derives them from the record's seeds
        entry.setdefault("probe_seed", look_seed(record["probe"]["seed"], entry["look"]))
        entry.setdefault("knockout_seed", look_seed(knockout_seed, entry["look"]))
    return record


def typed(partial: dict, **geometry) -> Record:
    """The validated `Record` of ``complete(partial)``."""
    return Record.of(complete(partial, **geometry))
