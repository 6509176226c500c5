"""Baseline files: one JSON scan record per (model, build), written atomically.

File name: ``<model name>--<recipe>.json`` in the baselines folder. The text is
diff-friendly: sorted keys, two-space indent, every float rounded to ``SIG_DIGITS``
significant digits, eigenvalue pairs on one line. Writes go to a temporary file in
the same folder, are fsynced, then ``os.replace``d over the target, so readers (and
concurrent pytest-xdist workers) only ever see a whole old or a whole new file.

`BaselineStore` is the one way the plugin, the CLI and the report find, read, validate,
write and list baselines. Its errors are typed (`BaselineMissing`, `BaselineCorrupt`,
`ForeignBaseline`: other probe settings), each one line naming the file and the fix.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import BaselineCorrupt, BaselineMissing, FileSystemError, ForeignBaseline
from ..fsio import JsonUnreadable, atomic_write_text, check_output, ensure_dir, read_json, remove_stale_temps, safe_name
from ..options import FRONT_END, flag
from .schema import Identity, Record, RecordLike, typed_record

SIG_DIGITS = 6
SUFFIX = ".json"
SEPARATOR = "--"
GEOMETRY_KEYS = ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "vocab", "attention_layers")
PROBE_KEYS = ("seed", "n", "L")
Seen = RecordLike | Identity  # what the comparisons read: a record, typed or not, or a stand-in (`geometry_record`)


def geometry_record(geometry: dict[str, Any], probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """A stand-in record that holds only a model's geometry (and ``probe``): what `compatibility` and
    `geometry_difference` read of a build that has not been measured yet."""
    geometry = {k: list(v) if isinstance(v, tuple) else v for k, v in geometry.items() if v is not None}
    return {"model": {"geometry": geometry}} | ({} if probe is None else {"probe": probe})


def baseline_path(folder: str | Path, model_name: str, build_name: str) -> Path:
    """``folder/<model>--<build name>.json``."""
    return Path(folder) / f"{safe_name(model_name)}{SEPARATOR}{build_name}{SUFFIX}"


def model_baselines(folder: str | Path, model_name: str) -> dict[str, Path]:
    """Every baseline file of ``model_name`` in ``folder``, by recipe."""
    prefix = f"{safe_name(model_name)}{SEPARATOR}"
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {
        p.name[len(prefix) : -len(SUFFIX)]: p
        for p in sorted(folder.glob(f"{prefix}*{SUFFIX}"))
        if SEPARATOR not in p.name[len(prefix) : -len(SUFFIX)]
    }


def orphans(folder: str | Path, model_name: str, used_recipes: Iterable[str]) -> list[Path]:
    """Baseline files of ``model_name`` that no recipe in ``used_recipes`` reads."""
    used = set(used_recipes)
    return [p for recipe, p in model_baselines(folder, model_name).items() if recipe not in used]


def round_sig(value: Any, digits: int = SIG_DIGITS) -> Any:
    """Floats (nested anywhere) rounded to ``digits`` significant digits; NaN/inf -> None."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {str(k): round_sig(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [round_sig(v, digits) for v in value]
    if hasattr(value, "item"):  # numpy scalar
        return round_sig(value.item(), digits)
    return value


_PAIR = re.compile(r"\[\s*(-?[\d.eE+-]+),\s*(-?[\d.eE+-]+)\s*\]")


def dumps(record: dict[str, Any], digits: int = SIG_DIGITS) -> str:
    """Stable text of a record: sorted keys, rounded floats, one line per eigenvalue pair."""
    text = json.dumps(round_sig(record, digits), sort_keys=True, indent=2, allow_nan=False)
    return _PAIR.sub(r"[\1, \2]", text) + "\n"


def write_baseline(path: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` to ``path`` atomically (`fsio.atomic_write_text` of `dumps`), after removing
    the temporary files a killed writer left in its folder."""
    path = Path(path)
    if path.parent.is_dir():
        remove_stale_temps(path.parent)
    return atomic_write_text(path, dumps(record))


def _fix() -> str:
    """How to record a baseline again, as the running front end says it."""
    if FRONT_END.get() == "cli":
        return "record it again with circuits record"
    return f"record it again with {flag('update')} (or circuits record)"


def record_problem(record: Any) -> str | None:
    """What makes ``record`` not a scan record of this schema (`schema.Record`), in a few words, or None."""
    typed = typed_record(record)
    return typed if isinstance(typed, str) else None


def validate(record: Any, source: str = "baseline") -> Record:
    """The validated `Record` of ``record`` (validated once: its `data` is ``record``; a `Record` is
    returned as it is), else a one-line `BaselineCorrupt` naming ``source``, the field and the fix."""
    typed = typed_record(record)
    if isinstance(typed, str):
        raise BaselineCorrupt(f"{source} {typed}; {_fix()}")
    return typed


def read_baseline(path: str | Path) -> dict[str, Any]:
    """The validated record dict in ``path`` (`read_record`'s `data`); a missing or corrupt file is a
    one-line BaselineError."""
    return read_record(path).data


def read_record(path: str | Path) -> Record:
    """The validated `Record` in ``path`` (`fsio.read_json`, validated once); a missing or corrupt
    file is a one-line BaselineError."""
    path = Path(path)
    named_like_one = path.name.endswith(SUFFIX) and SEPARATOR in path.name  # MODEL--BUILD.json
    try:
        record = read_json(path)
    except JsonUnreadable as error:
        if error.missing:
            raise BaselineMissing(f"baseline {path} does not exist; {_fix().replace(' again', '')}") from None
        if "folder" in error.reason or "regular file" in error.reason:
            fix = "pass a baseline .json file"
        elif "link loop" in error.reason:
            fix = "fix or remove the link"
        elif "longer than the system allows" in error.reason:
            fix = "shorten it"
        elif error.reason.startswith("cannot be read"):
            fix = "check its permissions"
        elif named_like_one:
            fix = f"delete it and {_fix()}"
        else:  # never advise deleting a file that may be anything
            raise _not_a_baseline(path, f"it {error.reason}") from None
        raise BaselineCorrupt(f"baseline {path} {error.reason}; {fix}") from None
    if not named_like_one and not (isinstance(record, dict) and "schema_version" in record):
        raise _not_a_baseline(path, "it holds no schema_version")
    typed = validate(record, f"baseline {path}")
    _same_heads_every_look(typed, path)
    return typed


def _same_heads_every_look(record: Record, path: Path) -> None:
    """A stored record's looks knock out the same heads (a recording measures every key head on every
    look; only a build's looks in a gate shrink to the undecided ones, `run.looks`). A look that
    dropped a head would move its row to the fixed rule, more lenient: refused, one line."""
    looks = record.looks or []
    first = sorted(looks[0].knockout_delta_sequences or {}) if looks else []
    for entry in looks[1:]:
        heads = sorted(entry.knockout_delta_sequences or {})
        if heads != first:
            raise BaselineCorrupt(
                f"baseline {path}: looks[{entry.look - 2}] (look {entry.look}) knocks out {len(heads)} head(s), "
                f"look 2 {len(first)} ({', '.join(sorted(set(first) - set(heads))[:4])} missing): a stored "
                f"record's looks knock out the same heads; {_fix()}"
            )


def _not_a_baseline(path: Path, why: str) -> BaselineCorrupt:
    return BaselineCorrupt(
        f"{path} is not a pytest-circuits baseline ({why}); pass a baseline file, MODEL--BUILD.json as "
        "circuits record writes it (circuits baselines lists the shipped ones)"
    )


def _geometry(record: Seen) -> dict[str, Any]:
    """The geometry ``record`` states, as given ({} when it states none)."""
    model = Identity.of(record).model
    return {} if model is None or model.geometry is None else model.geometry.model_dump(exclude_unset=True)


def geometry_difference(baseline: Seen, record: Seen) -> str:
    """``"n_layers 30 vs 2, n_heads 9 vs 4, ..."``: where the two records' geometries differ ("" when
    they do not, or when either record states none)."""
    geo_b, geo_r = _geometry(baseline), _geometry(record)
    if not geo_b or not geo_r:
        return ""
    return ", ".join(f"{k} {geo_b.get(k)} vs {geo_r.get(k)}" for k in GEOMETRY_KEYS if geo_b.get(k) != geo_r.get(k))


def other_model_type(baseline: Seen, record: Seen) -> str:
    """``"qwen3 vs llama"`` when both records name their ``config.model_type`` and the two differ, else ""."""
    tb, tr = (model.model_type if (model := Identity.of(r).model) else None for r in (baseline, record))
    return f"{tb} vs {tr}" if tb and tr and tb != tr else ""


def _swap_hint() -> str:
    """How the running front end asks for a base-model swap."""
    if FRONT_END.get() == "cli":
        return "circuits gate --across-models"
    return f"{flag('swap-baseline')} FILE"


def _described(record: Seen, fallback: str) -> str:
    """``smollm2-135m (30 layers x 9 heads, vocab 49152)``."""
    model = Identity.of(record).model
    layers, heads, vocab = (_geometry(record).get(k) for k in ("n_layers", "n_heads", "vocab"))
    return f"{(model.name if model else None) or fallback} ({layers} layers x {heads} heads, vocab {vocab})"


def compatibility(baseline: Seen, record: Seen, source: str = "baseline", across: bool = False) -> list[str]:
    """Notes on comparing ``record`` with ``baseline``; other probe settings are refused.

    Another model type of the same geometry is refused unless ``across`` (a `ForeignBaseline`).
    Another geometry (or ``across``) is another base model: compared on the model-level
    cross-model invariants only, with a note saying that per-head invariants were not. Same
    geometry but another weight fingerprint (a new checkpoint of the same shape) is compared,
    with a note saying the weights differ.
    """
    b, r = Identity.of(baseline), Identity.of(record)
    pb, pr = (_probe(x) for x in (b, r))
    pdiff = [f"{k}={pb[k]} vs {pr[k]}" for k in PROBE_KEYS if pb[k] != pr[k]]
    if pdiff:
        seed, n, length = (pb[k] for k in PROBE_KEYS)
        raise ForeignBaseline(
            f"{source} was recorded with other probe settings ({', '.join(pdiff)}); run with "
            f"{flag('probe-seed')} {seed} {flag('probe-n')} {n} {flag('probe-length')} {length} or record it again"
        )
    _same_text(b, r, source)
    diff = geometry_difference(baseline, record)
    kinds = other_model_type(baseline, record)
    if kinds and not (diff or across):  # a same-shape model of another type: not a build of this one
        raise ForeignBaseline(
            f"{source} was recorded from another model (model type {kinds}): it is not a build of this model; "
            f"gate against this model's own baseline, or ask for a base-model swap ({_swap_hint()})"
        )
    if diff or across:
        why = f"geometry {diff}" if diff else "compared as two base models"
        return [
            f"note: across models: {_described(record, 'this model')} against {_described(baseline, 'the baseline')} "
            f"from {source}; per-head invariants were not compared ({why}; heads do not correspond across "
            "models), only the model-level swap invariants"
        ]
    notes = []
    kb, kr = (x.build.kv_cache if x.build else None for x in (b, r))
    if kb != kr:
        notes.append(
            f"note: the KV cache differs from the baseline's (baseline: {_cache_name(kb)}, this build: "
            f"{_cache_name(kr)}); the probe and knockouts read keys and values through this build's cache"
        )
    eb, er = engine_of(baseline), engine_of(record)
    if eb != er:
        notes.append(
            f"note: the probe ran on another engine than the baseline's (baseline: {eb}, this build: {er}); "
            f"its copy loss and gain are {er}'s logits against {eb}'s"
        )
    fb, fr = (x.model.fingerprint if x.model else None for x in (b, r))
    if fb and fr and fb != fr:
        notes.append(
            f"note: the weights differ from those the baseline was recorded from (weight fingerprint: baseline "
            f"{_short(fb)}, this build {_short(fr)}; a sha256 over the name and sha256 of each weight file "
            "of the model folder, not any one file's); comparing the same geometry"
        )
    return notes


def _same_text(baseline: Record | Identity, record: Record | Identity, source: str) -> None:
    """Refuse, in one line, a baseline recorded on another probe: the random-repeat one against the own-text
    one, another text file (sha256), or the same file read into other ids (another tokenizer)."""
    tb, tr = (getattr(x.probe, "text", None) for x in (baseline, record))

    def probe_name(text) -> str:
        return "the random-repeat probe" if text is None else f"the own text {text.file} (sha256 {_short(text.sha256)})"

    if (tb and tb.sha256) != (tr and tr.sha256):  # another probe, or another file
        fix = f"drop {flag('probe-text')}" if tb is None else f"give {flag('probe-text')} {tb.file} (that file)"
        raise ForeignBaseline(
            f"{source} was recorded on {probe_name(tb)}, this run asks for {probe_name(tr)}; {fix} or record it again"
        )
    if tb and tr and None not in (tb.ids_sha256, tr.ids_sha256) and tb.ids_sha256 != tr.ids_sha256:
        raise ForeignBaseline(
            f"{source} was recorded on {tb.file} read into other ids (sha256 {_short(tb.ids_sha256)} vs "
            f"{_short(tr.ids_sha256)}: another tokenizer); record it again with this model's"
        )


def _probe(record: Record | Identity) -> dict[str, Any]:
    """``{seed, n, L}`` of the probe ``record`` states (None where it states none)."""
    return {k: getattr(record.probe, k, None) for k in PROBE_KEYS}


def engine_of(record: Seen) -> str:
    """``llama.cpp`` or ``torch``: what ran a record's probe (its build identity's ``engine``)."""
    build = Identity.of(record).build
    engine = build.engine if build else None
    return str(engine).partition(" ")[0] if engine else "torch"


def _cache_name(kv_cache: str | None) -> str:
    """``"q4_0-r128"`` of a build identity's ``kv_cache`` line; ``full precision`` without one."""
    return kv_cache.partition(":")[0] if kv_cache else "full precision"


def _short(fingerprint: str) -> str:
    return fingerprint.split(":")[-1][:12]


UNCHANGED_REL, UNCHANGED_ABS = 1e-3, 1e-6  # a figure within this of the stored one has not moved
VOLATILE_KEYS = ("versions",)  # library versions alone do not make a baseline change


def unchanged(old: Any, new: Any, rel: float = UNCHANGED_REL, atol: float = UNCHANGED_ABS) -> bool:
    """True when ``new`` holds the same keys, flags and identity as ``old`` and every number is
    within ``atol + rel * |old|`` of it (re-recording an unchanged build then rewrites nothing)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = set(old) | set(new)
        return all(
            k in old and k in new and unchanged(old[k], new[k], rel, atol) for k in keys if k not in VOLATILE_KEYS
        )
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(unchanged(a, b, rel, atol) for a, b in zip(old, new))
    numbers = (int, float)
    if (
        isinstance(old, numbers)
        and isinstance(new, numbers)
        and not isinstance(old, bool)
        and not isinstance(new, bool)
    ):
        return bool(abs(new - old) <= atol + rel * abs(old))
    return bool(old == new)


def is_shipped(folder: str | Path) -> bool:
    """True for the installed package's own baselines folder (`model.named.SHIPPED_BASELINES`)."""
    from ..model import named

    return _same_file(Path(folder), Path(named.SHIPPED_BASELINES))


def shipped_baselines() -> dict[str, Path]:
    """The package's shipped baseline files (`model.named.SHIPPED_BASELINES`) by name, ``tiny-induction--fp32``."""
    from ..model import named

    return {p.name.removesuffix(SUFFIX): p for p in sorted(Path(named.SHIPPED_BASELINES).glob(f"*{SUFFIX}"))}


def baseline_file(text: str | Path) -> Path:
    """The baseline file a user typed, by one rule: a file here first, then a shipped one. The path
    itself when it exists or names a folder; a bare name (``tiny-induction--fp32``, with or without
    ``.json``) is the file of that name here when there is one, else the shipped baseline of that name
    (`shipped_baselines`); anything else is returned as typed (reading it says why not)."""
    path = Path(text)
    if _exists(path) or len(path.parts) != 1:
        return path
    here = path.with_name(path.name.removesuffix(SUFFIX) + SUFFIX)
    if _exists(here):
        return here
    return shipped_baselines().get(path.name.removesuffix(SUFFIX), path)


def _exists(path: Path) -> bool:
    """`Path.exists`, False where the system cannot even look (a name too long): reading it says why."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def baseline_line(path: Path) -> str:
    """The gate's first line: the baseline file used, and whether it is a shipped one or a file here
    that takes the place of the shipped baseline of its name (`baseline_file`'s rule)."""
    shipped = shipped_baselines().get(path.name.removesuffix(SUFFIX))
    if shipped is not None and _same_file(shipped, path):
        return f"baseline {shipped.name}, shipped with pytest-circuits (circuits baselines lists its file)"
    if shipped is not None:
        return f"baseline {path.absolute()}, not the shipped baseline of that name"
    return f"baseline {path.absolute()}"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return False


def same_geometry(folder: str | Path, build_name: str, geometry: dict[str, Any], exclude: str) -> dict[str, Path]:
    """Baselines of ``build_name`` in ``folder`` of other models than ``exclude`` whose geometry is
    ``geometry`` (a `Geometry`'s fields), by the model name in their file name: the baseline a
    renamed candidate folder was probably meant to be gated against. Unreadable files are left out."""
    from ..errors import BaselineError

    found = {}
    folder, ending = Path(folder), f"{SEPARATOR}{build_name}{SUFFIX}"
    own = baseline_path(folder, exclude, build_name).name
    for path in sorted(folder.glob(f"*{ending}")) if folder.is_dir() else []:
        if path.name == own:
            continue
        try:
            record = read_record(path)
        except BaselineError:
            continue
        if not geometry_difference(record, geometry_record(geometry)):
            found[path.name[: -len(ending)]] = path
    return found


class BaselineStore:
    """The baselines folder: one file per (model, build), found, read, written and listed here.

    The package's shipped baselines are read only: no command writes there (`is_shipped`).
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def path(self, model_name: str, build: str) -> Path:
        """``folder/<model>--<build>.json``."""
        return baseline_path(self.folder, model_name, build)

    def read(self, model_name: str, build: str) -> Record:
        """The validated baseline of ``build`` (`read_record`); `BaselineMissing` or `BaselineCorrupt` otherwise."""
        return read_record(self.path(model_name, build))

    def write(self, model_name: str, build: str, record: dict[str, Any], force: bool = True) -> tuple[Path, bool]:
        """Write ``record`` as the baseline of ``build``, atomically: ``(path, written)``.

        Without ``force`` an existing valid baseline that `unchanged` says holds the same figures
        is left as it is, so re-recording an unchanged build churns no diff in review.
        """
        path = self.path(model_name, build)
        self.refuse_shipped(path)
        validate(record, f"the scan record of {build}")
        if path.parent.is_dir():
            remove_stale_temps(path.parent)  # what a killed writer left
        if not force and path.is_file():
            try:
                if unchanged(read_baseline(path), round_sig(record)):
                    return path, False
            except BaselineCorrupt:
                pass  # rewritten below
        return write_baseline(path, record), True

    def refuse_shipped(self, path: Path) -> None:
        """A one-line `FileSystemError` when this store is the package's own (read-only) folder."""
        if is_shipped(self.folder):
            raise FileSystemError(
                f"cannot write {path}: the baselines shipped with pytest-circuits are read only; "
                f"record into your own folder ({flag('baselines')} DIR, default ./baselines)"
            )

    def check_writable(self, path: Path | None = None) -> None:
        """Before any measuring: the folder exists (created if missing) and is not the shipped one,
        and ``path`` in it may be written (`fsio.check_output`: never a link), so a record that would
        end in a write error ends at once instead of after the scan."""
        self.refuse_shipped(self.folder)
        ensure_dir(self.folder)
        if path is not None:
            check_output(path)

    def builds(self, model_name: str) -> dict[str, Path]:
        """Every baseline file of ``model_name`` here, by build."""
        return model_baselines(self.folder, model_name)

    def orphans(self, model_name: str, used_builds: Iterable[str]) -> list[Path]:
        """Baselines of ``model_name`` that no build in ``used_builds`` reads."""
        return orphans(self.folder, model_name, used_builds)
