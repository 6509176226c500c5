"""One build's scan as K separate jobs: each job writes the part of one knockout shard, one
command merges the parts into the record the unsharded scan gives, bit for bit.

A part is ``{"part": {"format", "index", "of", "layers"}, "record": <scan record>}``: the full
scan record of the build (rung 1, the probe, the screen) with exact knockout deltas only for the
heads of its shard's layers (`rungs.knockout_shards.layer_shards`: contiguous layers of equal replay
cost). The merge takes each head's ``knockout_delta*`` figures from the part that owns its layer
and checks that everything else is the same in every part (one build, settings and weights).
Every part is validated (`schema.PartInfo`, `schema.Record`: a part holds knockout figures for
its layers only, all of them), and the merge proves coverage (one K, each index 1..K once, each
layer once); any flaw is refused with one line naming the part and the field. Jobs share no folder:
only the part files travel (a CI matrix's artifacts, a Slurm array's output directory).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ShardError

if TYPE_CHECKING:
    from .schema import HeadRow, RecordLike

KNOCKOUT_PREFIX = "knockout_delta"  # a head row's figures that the part owning its layer measured
# where two parts of one build may differ: the spec the model was typed as (a job's own path)
JOB_LOCAL = (("model", "spec"),)


def dumps_part(part: dict[str, Any]) -> str:
    """A part's text: its record rounded as a baseline is (`store.round_sig`), so the merge writes the same bytes."""
    from .store import round_sig

    return json.dumps({"part": part["part"], "record": round_sig(part["record"])}, sort_keys=True, indent=1) + "\n"


def read_part(path: Path) -> dict[str, Any]:
    """A part file, checked (`check_part`), or one line saying why it is not one."""
    from ..fsio import JsonUnreadable, read_json

    try:
        data = read_json(path)
    except JsonUnreadable as error:
        if error.missing:
            raise ShardError(f"part {path} does not exist") from None
        if "folder" in error.reason:
            raise ShardError(f"part {path} {error.reason}; name the part files (circuits merge DIR/*.json)") from None
        raise ShardError(f"part {path} {error.reason}; write it again") from None
    return check_part(str(path), data)


WRITE_AGAIN = "write it again (circuits record --shard I/K --out FILE)"


def check_part(name: str, data: Any) -> dict[str, Any]:
    """``data`` if it is a part (`schema.PartInfo` header, a valid scan record whose knockout
    figures are its layers' only, every one of them there), else one `ShardError` line naming ``name``."""
    from pydantic import ValidationError

    from .schema import PartInfo, problem, typed_record

    if not isinstance(data, dict) or not isinstance(data.get("part"), dict) or "record" not in data:
        raise ShardError(f"{name} is not a shard part (circuits record --shard i/K --out FILE writes one)")
    try:
        meta = PartInfo.model_validate(data["part"])
    except ValidationError as error:
        raise ShardError(f"{name} is not a valid shard part: part.{problem(error)}; {WRITE_AGAIN}") from None
    record = typed_record(data["record"])
    if isinstance(record, str):
        raise ShardError(f"{name}: its record {record}; {WRITE_AGAIN}")
    n_layers = record.model.geometry.n_layers
    beyond = [layer for layer in meta.layers if layer >= n_layers]
    if beyond:
        raise ShardError(f"{name} claims layer(s) {_listed(beyond)}, the model has {n_layers} layers; {WRITE_AGAIN}")
    if record.knockout is None:
        raise ShardError(f"{name} holds no knockout scan, so no part of one; {WRITE_AGAIN}")
    own = set(meta.layers)
    exact = record.knockout.screened is None  # unscreened: every head of its layers knocked out
    strays = [r.head for r in record.heads if r.layer not in own and _knockout_figures(r)]
    unmeasured = [r.head for r in record.heads if r.layer in own and exact and r.knockout_delta is None]
    if strays or unmeasured:
        why = (
            f"knockout figures of {_listed(strays)}, outside its layers {_listed(meta.layers)}"
            if strays
            else f"no knockout_delta for {_listed(unmeasured)}, heads of its layers {_listed(meta.layers)}"
        )
        raise ShardError(
            f"{name} is not the part it says (shard {meta.index}/{meta.of}): it holds {why}; {WRITE_AGAIN}"
        )
    measured = _measured_figures(record)
    if len(measured) > 1:  # a head stripped of its interval or sequences: a weaker figure, not another
        fewest = min(measured, key=len)
        raise ShardError(
            f"{name} holds fewer knockout figures for {_listed(measured[fewest])} ({', '.join(sorted(fewest))}) "
            f"than for its other heads; {WRITE_AGAIN}"
        )
    return data


def _measured_figures(record: RecordLike) -> dict[frozenset[str], list[str]]:
    """The heads knocked out exactly (a knockout_delta), by the set of knockout figures each holds."""
    from .schema import Record

    found: dict[frozenset[str], list[str]] = {}
    for row in Record.of(record).heads:
        if row.knockout_delta is not None:
            found.setdefault(frozenset(_knockouts_of(row)), []).append(row.head)
    return found


def _knockouts_of(row: HeadRow) -> list[str]:
    """The knockout figures a head row holds (a figure absent or None: not held)."""
    held = row.model_dump()
    return [k for k, value in held.items() if k.startswith(KNOCKOUT_PREFIX) and value is not None]


def _knockout_figures(row: HeadRow) -> bool:
    return bool(_knockouts_of(row))


def _listed(items: Iterable[Any], most: int = 6) -> str:
    words = [str(i) for i in items]
    return ", ".join(words[:most]) + (f" and {len(words) - most} more" if len(words) > most else "")


def _without_knockouts(record: dict[str, Any]) -> dict[str, Any]:
    """The record less what only one part measures (its heads' knockout figures) and job-local fields."""
    from .schema import head_dicts

    plain = copy.deepcopy(record)
    for row in head_dicts(plain):
        for key in [k for k in row if k.startswith(KNOCKOUT_PREFIX)]:
            del row[key]
    for section, key in JOB_LOCAL:
        (plain.get(section) or {}).pop(key, None)
    return plain


def _first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The dotted path of the first place two JSON values differ, else None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{where}{key}"
            found = _first_difference(a[key], b[key], f"{where}{key}.")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return where.rstrip(".")
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{where}{i}.")
            if found:
                return found
        return None
    return None if a == b else where.rstrip(".")


WHY = {"model": "other weights or another model", "build": "another build", "probe": "other probe settings"}


def merge_parts(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The unsharded record from every part of one build's scan (``(name, part)`` pairs, any order).

    Each part is checked (`check_part`), then coverage is proven: one K in every part, every index
    1..K exactly once, every layer of the model in exactly one part; anything else is one line."""
    if not parts:
        raise ShardError("no parts to merge")
    parts = [(name, check_part(name, part)) for name, part in parts]
    name0, first = parts[0]
    total = first["part"]["of"]
    owners: dict[int, str] = {}
    layer_owner: dict[int, tuple[str, dict[str, Any]]] = {}
    base = _without_knockouts(first["record"])
    for name, part in parts:
        meta = part["part"]
        if meta["of"] != total:
            raise ShardError(
                f"{name} is shard {meta['index']}/{meta['of']}, {name0} one of {total}: parts of two splits"
            )
        if meta["index"] in owners:
            raise ShardError(f"{owners[meta['index']]} and {name} are both shard {meta['index']}/{total}")
        owners[meta["index"]] = name
        where = _first_difference(base, _without_knockouts(part["record"]))
        if where is not None:
            why = WHY.get(where.split(".")[0], "other settings or figures")
            raise ShardError(
                f"{name} differs from {name0} in {where} ({why}): merge only the parts of one build, settings and weights"
            )
        for layer in meta["layers"]:
            if layer in layer_owner:
                raise ShardError(
                    f"{layer_owner[layer][0]} and {name} both claim layer {layer}: parts of one split own "
                    "disjoint layers; write them again"
                )
            layer_owner[layer] = (name, part)
    missing = [i for i in range(1, total + 1) if i not in owners]
    if missing:
        raise ShardError(f"shard(s) {', '.join(f'{i}/{total}' for i in missing)} missing: merge all {total} parts")
    from .schema import Record, head_dicts

    typed_first = Record.of(first["record"])
    n_layers = typed_first.model.geometry.n_layers
    uncovered = [layer for layer in range(n_layers) if layer not in layer_owner]
    if uncovered:
        raise ShardError(f"no part holds layer(s) {_listed(uncovered)}: the parts do not cover the model's {n_layers}")
    kinds = {keys: name for name, part in parts for keys in _measured_figures(part["record"])}
    if len(kinds) > 1:
        fewest = min(kinds, key=len)
        raise ShardError(
            f"{kinds[fewest]} holds fewer knockout figures per head ({', '.join(sorted(fewest))}) than the other "
            f"parts: parts of one build's scan measure every head alike; {WRITE_AGAIN}"
        )
    merged: dict[str, Any] = copy.deepcopy(first["record"])
    for i, (row, head) in enumerate(zip(head_dicts(merged), typed_first.heads)):
        theirs = head_dicts(layer_owner[head.layer][1]["record"])[i]
        for key in [k for k in row if k.startswith(KNOCKOUT_PREFIX)]:
            row[key] = theirs.get(key)
    return merged


def merge_files(paths: list[Path], output: Path) -> tuple[dict[str, Any], int]:
    """``circuits merge``: the record merged from the part files ``paths`` (`merge_parts`), checked,
    written to ``output``; ``(record, parts merged)``. An output that is one of the parts, or that
    may not be written (`fsio.check_output`), is refused before anything is read."""
    import os

    from ..fsio import check_output
    from .store import validate, write_baseline

    for path in paths:
        if Path(os.path.abspath(output)) == Path(os.path.abspath(path)) or (
            output.exists() and path.exists() and os.path.samefile(output, path)
        ):
            raise ShardError(f"-o {output} is the part {path}: write the merged record to another file")
    check_output(output)
    merged = validate(merge_parts([(str(path), read_part(path)) for path in paths]), "the merged record").data
    write_baseline(output, merged)
    return merged, len(paths)


def part_paths(pattern: str, said: str) -> list[Path]:
    """The part files ``pattern`` names (a glob, or a folder: its ``*.json``), sorted; none is one line."""
    import glob

    path = Path(pattern).expanduser()
    found = sorted(path.glob("*.json")) if path.is_dir() else sorted(Path(p) for p in glob.glob(str(path)))
    if not found:
        raise ShardError(
            f"{said} {pattern}: no file matches; name the parts (quote a glob: '{pattern}') or their folder"
        )
    return found


def merged_by_build(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Each build's merged record (`merge_parts`) from part files of one or more builds, any order."""
    from .schema import Record
    from .store import validate

    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for path in paths:
        part = read_part(path)
        build_name = Record.of(part["record"]).build.recipe  # a part read is a valid record (`check_part`)
        groups.setdefault(build_name, []).append((str(path), part))
    return {
        build_name: validate(merge_parts(parts), f"the record merged from the parts of {build_name}").data
        for build_name, parts in groups.items()
    }
