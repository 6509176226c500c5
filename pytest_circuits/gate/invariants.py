"""The precision-swap gate: invariants of a build checked against a baseline scan record.

Every check reads two scan records (dicts, see `record.py`): ``before`` (the baseline)
and ``after`` (the build under test). Each returns an `InvariantResult` whose message is
a table of the heads and numbers that moved. Never gate on one number alone
(DEFINITIONS.md): kappa AND kappa_trace, plus behaviour (copy loss, knockouts).

Invariants (``INVARIANTS``):

- ``copying_heads``: every head flagged copying or suppression in the baseline keeps
  ``|kappa' - kappa| <= kappa`` and ``|kappa_trace' - kappa_trace| <= kappa``; every head
  keeps ``|kappa_trace' - kappa_trace| <= kappa`` (trace-weighted is the stable one); and
  the Spearman rank correlation of kappa across the heads the baseline tells apart from the
  null (``|kappa_z| >= 2``; noise heads only shuffle) stays ``>= rank``.
- ``kappa_distribution``: the mean over heads of ``kappa_z' - kappa_z`` (shift against the
  rotation null, in null standard deviations) stays within ``+-shift``.
- Both kappa invariants leave out heads whose OV gain ``sum_i |lambda_i|`` is below
  ``min_ov_gain`` x the baseline's largest: such a head writes almost nothing, and
  quantization noise on the scale of the model's big weights sets its eigenvalues' directions.
- ``copy_loss``: ``|copy_loss' - copy_loss| <= copy_loss`` and
  ``|copy_gain' - copy_gain| <= copy_gain`` (nats).
- ``induction_heads``: the baseline's top-``top_k`` prefix-matching heads scoring at least
  ``min_score`` keep ``prefix_matching`` within ``+-prefix``; likewise the top
  previous-token heads keep ``previous_token`` (the first half of the induction circuit).
- ``knockout_deltas``: the baseline's top-``top_k`` heads by knockout delta (delta at least
  ``min_delta`` nats) keep ``|delta' - delta| <= knockout * |delta|``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from ..assertions import spearman  # one Spearman for the gate and the users' helpers
from ..rungs.kappa import ov_gain
from .record import record_eigenvalues

INVARIANTS = ("copying_heads", "kappa_distribution", "copy_loss", "induction_heads", "knockout_deltas")
MAX_ROWS = 20
RANK_MIN_Z = 2.0  # heads in the rank correlation: those the baseline tells apart from the null


@dataclass(frozen=True)
class Tolerances:
    """Gate tolerances; each is an ini key ``circuits_tol_<name>`` and a marker keyword."""

    kappa: float = 0.15  # |delta kappa| and |delta kappa_trace| per head
    rank: float = 0.80  # minimum Spearman rank correlation of kappa across heads
    shift: float = 1.0  # |mean delta kappa_z| across heads, in null standard deviations
    copy_loss: float = 0.25  # |delta copy loss|, nats
    copy_gain: float = 0.25  # |delta copy gain|, nats
    prefix: float = 0.10  # |delta prefix_matching| / |delta previous_token| of key heads
    knockout: float = 0.5  # |delta knockout_delta| / |knockout_delta| of key heads
    top_k: int = 3  # key heads per routing score and for knockouts
    min_score: float = 0.2  # a routing score below this does not make a key head
    min_delta: float = 0.1  # a knockout delta below this (nats) does not make a key head
    min_ov_gain: float = 0.01  # heads with OV gain below this x the largest: kappa not compared

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def updated(self, overrides: dict) -> Tolerances:
        """A copy with ``overrides`` applied; unknown names or bad values raise ValueError."""
        unknown = sorted(set(overrides) - set(self.names()))
        if unknown:
            raise ValueError(f"unknown tolerance(s) {', '.join(unknown)}; known: {', '.join(self.names())}")
        clean = {}
        for name, value in overrides.items():
            kind = int if name == "top_k" else float
            try:
                clean[name] = kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"tolerance {name} must be a number, got {value!r}") from None
            if clean[name] < 0 and name != "rank":
                raise ValueError(f"tolerance {name} must be >= 0, got {value!r}")
        return replace(self, **clean)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class InvariantResult:
    """One invariant of one build against one baseline."""

    invariant: str
    build: str
    against: str  # "fp32 baseline" or "own baseline"
    passed: bool
    message: str
    moved: list[dict] = field(default_factory=list)  # head, metric, before, after, tolerance

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- helpers


def _heads(record: dict) -> dict[str, dict]:
    return {row["head"]: row for row in record.get("heads", [])}


def _num(value) -> float:
    """A float, NaN for None (missing knockouts)."""
    return float("nan") if value is None else float(value)


def _signed(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:+.3g}" if abs(x) < 1e-3 and x != 0 else f"{x:+.3f}"


def moved_row(head: str, metric: str, before: float, after: float, tolerance: float, **extra) -> dict:
    return {"head": head, "metric": metric, "before": before, "after": after, "tolerance": tolerance, **extra}


def format_moved(rows: list[dict], max_rows: int = MAX_ROWS) -> str:
    """``L1H2 kappa +0.910 -> -0.880 (tolerance 0.10)`` lines, at most ``max_rows``."""
    lines = []
    width = max((len(str(r["head"])) for r in rows), default=4)
    mwidth = max((len(r["metric"]) for r in rows), default=6)
    for r in rows[:max_rows]:
        note = f" {r['note']}" if r.get("note") else ""
        lines.append(
            f"  {str(r['head']):<{width}} {r['metric']:<{mwidth}} {_signed(r['before'])} -> "
            f"{_signed(r['after'])} (tolerance {r['tolerance']:.3g}){note}"
        )
    if len(rows) > max_rows:
        lines.append(f"  ... and {len(rows) - max_rows} more")
    return "\n".join(lines)


def _result(invariant, build, against, failed, checked, header_ok, header_bad) -> InvariantResult:
    if failed:
        return InvariantResult(invariant, build, against, False, f"{header_bad}\n{format_moved(failed)}", failed)
    return InvariantResult(invariant, build, against, True, f"{header_ok} ({checked} checked)", [])


def _pairs(before: dict, after: dict):
    """Heads present in both records, in the baseline's order."""
    b, a = _heads(before), _heads(after)
    return [(name, b[name], a[name]) for name in b if name in a]


def ov_gains(record: dict) -> dict[str, float]:
    """Each head's OV gain ``sum_i |lambda_i|``: the ``ov_gain`` column, or from the stored
    eigenvalues for records written before that column existed; empty when neither is there."""
    heads = _heads(record)
    if heads and all(row.get("ov_gain") is not None for row in heads.values()):
        return {name: float(row["ov_gain"]) for name, row in heads.items()}
    return {name: float(ov_gain(lam)) for name, lam in record_eigenvalues(record).items() if lam.size}


def negligible_heads(record: dict, min_ov_gain: float) -> set[str]:
    """Heads whose OV gain is below ``min_ov_gain`` x the record's largest."""
    gains = ov_gains(record)
    if not gains or min_ov_gain <= 0:
        return set()
    largest = max(gains.values())
    return {name for name, gain in gains.items() if gain < min_ov_gain * largest}


def _compared_pairs(before: dict, after: dict, tol: Tolerances):
    """``(pairs, note)``: the heads the kappa invariants compare, and a note naming how many
    negligible heads were left out ("" when none)."""
    negligible = negligible_heads(before, tol.min_ov_gain)
    pairs = [(name, b, a) for name, b, a in _pairs(before, after) if name not in negligible]
    if not negligible:
        return pairs, ""
    return pairs, f"; {len(negligible)} heads with OV gain < {tol.min_ov_gain:g} x the largest not compared"


# ---------------------------------------------------------------- invariants


def check_copying_heads(before: dict, after: dict, tol: Tolerances, build: str, against: str) -> InvariantResult:
    """Copying/suppression heads keep kappa and kappa_trace; kappa keeps its rank order."""
    failed, checked = [], 0
    pairs, skipped = _compared_pairs(before, after, tol)
    for name, b, a in pairs:
        metrics = ["kappa", "kappa_trace"] if (b.get("copying") or b.get("suppression")) else ["kappa_trace"]
        for metric in metrics:
            checked += 1
            x, y = _num(b.get(metric)), _num(a.get(metric))
            if not abs(y - x) <= tol.kappa:
                role = "copying" if b.get("copying") else "suppression" if b.get("suppression") else ""
                failed.append(moved_row(name, metric, x, y, tol.kappa, note=role))
    ranked = [(b, a) for _, b, a in pairs if abs(_num(b.get("kappa_z"))) >= RANK_MIN_Z]
    if len(ranked) >= 3:
        checked += 1
        rho = spearman([_num(b.get("kappa")) for b, _ in ranked], [_num(a.get("kappa")) for _, a in ranked])
        if not math.isnan(rho) and rho < tol.rank:
            failed.append(moved_row(f"{len(ranked)} heads", "rank corr", 1.0, rho, tol.rank,
                                    note=f"(Spearman of kappa over heads with |kappa_z| >= {RANK_MIN_Z:g})"))
    return _result(
        "copying_heads", build, against, failed, checked,
        f"copying heads of {build} survive against the {against}{skipped}",
        f"copying heads of {build} moved against the {against}{skipped}:",
    )


def check_kappa_distribution(before: dict, after: dict, tol: Tolerances, build: str, against: str) -> InvariantResult:
    """Mean shift across heads of kappa_z (and kappa_trace_z when recorded) within +-shift null sds."""
    pairs, skipped = _compared_pairs(before, after, tol)
    failed, shifts = [], {}
    for metric in ("kappa_z", "kappa_trace_z"):
        dz = np.array([_num(a.get(metric)) - _num(b.get(metric)) for _, b, a in pairs], float)
        dz = dz[np.isfinite(dz)]
        if not dz.size:
            continue
        shifts[metric] = shift = float(dz.mean())
        if not abs(shift) <= tol.shift:
            mean_b = float(np.nanmean([_num(b.get(metric)) for _, b, _ in pairs]))
            failed.append(moved_row("all heads", f"mean {metric}", mean_b, mean_b + shift, tol.shift))
            # name the heads that moved most, so the table says where the shift came from
            order = sorted(pairs, key=lambda p: -abs(_num(p[2].get(metric)) - _num(p[1].get(metric))))
            for name, b, a in order[:5]:
                failed.append(moved_row(name, metric, _num(b.get(metric)), _num(a.get(metric)), tol.shift))
    said = ", ".join(f"mean d{m} {v:+.2f}" for m, v in shifts.items())
    return _result(
        "kappa_distribution", build, against, failed, len(pairs),
        f"kappa distribution of {build} not shifted against the {against} ({said}){skipped}",
        f"kappa distribution of {build} shifted against the null, compared with the {against}{skipped}:",
    )


def check_copy_loss(before: dict, after: dict, tol: Tolerances, build: str, against: str) -> InvariantResult:
    """Copy loss and copy gain (nats) within tolerance, both directions."""
    failed = []
    for metric, t in (("copy_loss", tol.copy_loss), ("copy_gain", tol.copy_gain)):
        x, y = _num(before.get(metric)), _num(after.get(metric))
        if not abs(y - x) <= t:
            failed.append(moved_row("model", metric, x, y, t))
    return _result(
        "copy_loss", build, against, failed, 2,
        f"copy loss {_num(after.get('copy_loss')):.3f} and gain {_num(after.get('copy_gain')):.3f} of {build} "
        f"within tolerance of the {against}",
        f"copy behaviour of {build} moved against the {against}:",
    )


def key_heads(record: dict, metric: str, top_k: int, minimum: float) -> list[str]:
    """The record's top-``top_k`` heads by ``metric`` among those scoring at least ``minimum``."""
    rows = [(r["head"], _num(r.get(metric))) for r in record.get("heads", [])]
    rows = [(h, v) for h, v in rows if not math.isnan(v) and v >= minimum]
    rows.sort(key=lambda hv: -hv[1])
    return [h for h, _ in rows[:top_k]]


def check_induction_heads(before: dict, after: dict, tol: Tolerances, build: str, against: str) -> InvariantResult:
    """Top prefix-matching (and previous-token) heads of the baseline keep their scores."""
    b, a = _heads(before), _heads(after)
    failed, checked = [], 0
    for metric, role in (("prefix_matching", "induction"), ("previous_token", "previous-token")):
        for name in key_heads(before, metric, tol.top_k, tol.min_score):
            checked += 1
            x = _num(b[name].get(metric))
            y = _num(a.get(name, {}).get(metric))
            if not abs(y - x) <= tol.prefix:
                failed.append(moved_row(name, metric, x, y, tol.prefix, note=role))
    if not checked:
        return InvariantResult(
            "induction_heads", build, against, True,
            f"the {against} has no induction or previous-token head scoring >= {tol.min_score}; nothing to check",
        )
    return _result(
        "induction_heads", build, against, failed, checked,
        f"induction heads of {build} survive against the {against}",
        f"induction heads of {build} moved against the {against}:",
    )


def check_knockout_deltas(before: dict, after: dict, tol: Tolerances, build: str, against: str) -> InvariantResult:
    """Key heads' knockout deltas keep their size: ``|d' - d| <= knockout * |d|``."""
    b, a = _heads(before), _heads(after)
    keys = key_heads(before, "knockout_delta", tol.top_k, tol.min_delta)
    if not keys:
        has_any = any(r.get("knockout_delta") is not None for r in before.get("heads", []))
        why = f"no head with knockout delta >= {tol.min_delta} nats" if has_any else "no knockout figures"
        return InvariantResult("knockout_deltas", build, against, True, f"the {against} has {why}; nothing to check")
    failed = []
    for name in keys:
        x = _num(b[name].get("knockout_delta"))
        y = _num(a.get(name, {}).get("knockout_delta"))
        allowed = tol.knockout * abs(x)
        if not abs(y - x) <= allowed:
            failed.append(moved_row(name, "knockout_delta", x, y, allowed, note=f"({tol.knockout:.0%} of its size)"))
    return _result(
        "knockout_deltas", build, against, failed, len(keys),
        f"knockout deltas of {build}'s key heads keep their size against the {against}",
        f"knockout deltas of {build}'s key heads changed against the {against}:",
    )


CHECKS = {
    "copying_heads": check_copying_heads,
    "kappa_distribution": check_kappa_distribution,
    "copy_loss": check_copy_loss,
    "induction_heads": check_induction_heads,
    "knockout_deltas": check_knockout_deltas,
}


def check(invariant: str, before: dict, after: dict, tol: Tolerances, build: str, against: str,
          fix: str | None = None) -> InvariantResult:
    """Run one invariant; a failed result's message ends with ``fix`` (the update command)."""
    result = CHECKS[invariant](before, after, tol, build, against)
    if not result.passed and fix:
        result.message = f"{result.message}\n{fix}"
    return result


def gate_all(before: dict, after: dict, tol: Tolerances, build: str, against: str, fix: str | None = None,
             invariants=INVARIANTS) -> list[InvariantResult]:
    """Every invariant (those whose figures both records hold)."""
    results = []
    for name in invariants:
        if name == "knockout_deltas" and not _has_knockout(after):
            continue
        results.append(check(name, before, after, tol, build, against, fix))
    return results


def _has_knockout(record: dict) -> bool:
    return any(r.get("knockout_delta") is not None for r in record.get("heads", []))


# ---------------------------------------------------------------- one build against its baselines


@dataclass
class GateOutcome:
    """What gating one invariant of one build produced: results, plus problems that fail it."""

    results: list[InvariantResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # missing / refused / corrupt baselines
    notes: list[str] = field(default_factory=list)  # e.g. "the weights differ"

    @property
    def passed(self) -> bool:
        return not self.problems and all(r.passed for r in self.results)

    def message(self) -> str:
        parts = list(self.notes) + list(self.problems) + [r.message for r in self.results if not r.passed]
        return "\n".join(parts)


def comparisons(recipe: str, reference: str) -> list[tuple[str, str]]:
    """``(baseline recipe, label)`` pairs a build is gated against: the reference, then its own."""
    if recipe == reference:  # its own baseline is the reference: missing it fails the gate
        return [(reference, f"{reference} baseline")]
    return [(reference, f"{reference} baseline"), (recipe, "own baseline")]


def gate_build(session, recipe: str, invariant: str, tol: Tolerances, fixes: dict[str, str]) -> GateOutcome:
    """Gate one invariant of ``recipe`` against the reference baseline and its own (drift).

    ``session`` provides ``record(recipe, knockout)``, ``load_baseline(recipe)`` (record, or
    raises BaselineError) and ``settings.reference``. A missing reference baseline is a
    problem (the gate fails); a missing own baseline only skips the drift comparison.
    ``fixes`` maps ``"reference"``/``"own"`` to the line that ends a failure message.
    """
    from ..errors import BaselineError
    from .store import compatibility

    if invariant not in CHECKS:
        from ..errors import CircuitsError

        raise CircuitsError(f"unknown invariant {invariant!r}; known: {', '.join(INVARIANTS)}")
    outcome = GateOutcome()
    candidate = session.record(recipe, knockout=invariant == "knockout_deltas")
    for base_recipe, label in comparisons(recipe, session.settings.reference):
        own = label == "own baseline"
        try:
            baseline = session.load_baseline(base_recipe)
            outcome.notes.extend(n for n in compatibility(baseline, candidate, label) if n not in outcome.notes)
        except BaselineError as error:
            if own and "does not exist" in str(error):
                continue
            outcome.problems.append(str(error))
            continue
        if invariant == "knockout_deltas" and not _has_knockout(baseline):
            outcome.problems.append(
                f"the {label} of {recipe} holds no knockout figures; record it again with knockouts"
            )
            continue
        outcome.results.append(
            check(invariant, baseline, candidate, tol, recipe, label, fixes.get("own" if own else "reference"))
        )
    return outcome


# ---------------------------------------------------------------- the pytest side (plugin.py stays thin)


@dataclass
class Collected:
    """Everything the gate tests of one run attached, gathered where the summary is printed."""

    results: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    records: dict = field(default_factory=dict)  # recipe -> scan record (only with --circuits-report)
    references: dict = field(default_factory=dict)  # recipe -> reference baseline record or None
    report_path: object = None
    used: bool = False

    def add(self, user_properties) -> None:
        for key, value in user_properties:
            if not key.startswith("circuits_"):
                continue
            self.used = True
            if key == "circuits_results":
                self.results.extend(value)
            elif key == "circuits_events":
                self.events.extend(e for e in value if e not in self.events)
            elif key in ("circuits_notes", "circuits_problems"):
                bucket = self.notes if key == "circuits_notes" else self.problems
                bucket.extend(v for v in value if v not in bucket)
            elif key == "circuits_record":
                recipe, record = value
                old = self.records.get(recipe)
                if old is None or _has_knockout(record) or not _has_knockout(old):
                    self.records[recipe] = record
            elif key == "circuits_reference":
                recipe, record = value
                self.references[recipe] = record


def fix_lines(session, recipe: str, test_path: str) -> dict[str, str]:
    """The closing line of a failure message: how to accept the change if it is intended."""
    s = session.settings
    update = "pytest {path} --circuits-model {model} --circuits-builds {r} --circuits-update"
    own = update.format(path=test_path, model=s.model, r=recipe)
    ref = update.format(path=test_path, model=s.model, r=s.reference)
    return {
        "own": f"if the change is intended, update the baseline: {own}",
        "reference": (
            f"if {recipe} may differ this much from {s.reference}, loosen the tolerance "
            "(@pytest.mark.circuits_tolerance(...) or circuits_tol_* in [tool.pytest.ini_options]); "
            f"if the {s.reference} build changed on purpose, update its baseline: {ref}"
        ),
    }


def gate_for_test(request, session, recipe: str, invariant: str, tol: Tolerances) -> GateOutcome:
    """`gate_build` for one pytest item; results travel as user properties (pytest-xdist safe)."""
    try:
        test_path = request.node.path.relative_to(request.config.rootpath)
    except ValueError:
        test_path = request.node.path
    outcome = gate_build(session, recipe, invariant, tol, fix_lines(session, recipe, str(test_path)))
    props = request.node.user_properties
    props.append(("circuits_results", [r.as_dict() for r in outcome.results]))
    props.append(("circuits_events", list(session.events)))
    props.append(("circuits_notes", [f"{recipe}: {n}" for n in outcome.notes]))
    props.append(("circuits_problems", list(outcome.problems)))
    if session.settings.report is not None:
        knockout = invariant == "knockout_deltas"
        props.append(("circuits_record", (recipe, session.record(recipe, knockout=knockout))))
        try:
            reference = session.load_baseline(session.settings.reference)
        except Exception:
            reference = None
        props.append(("circuits_reference", (recipe, reference)))
    return outcome


def baseline_lines(session, collected: Collected) -> list[str]:
    """Which baselines were written, compared, missing, corrupt, and orphaned (named)."""
    from .store import orphans

    lines = []
    for event, verb in (("written", "written"), ("compared", "compared"), ("missing", "missing"),
                        ("corrupt", "unreadable")):
        paths = sorted({e["path"] for e in collected.events if e["event"] == event})
        if paths:
            lines.append(f"baselines {verb}: {', '.join(paths)}")
    missing = sorted({e["recipe"] for e in collected.events if e["event"] == "missing"})
    for recipe in missing:
        lines.append(f"  record {recipe} with: {session.record_command(recipe)}")
    try:
        used = set(session.settings.builds) | {session.settings.reference}
        orphaned = orphans(session.settings.baselines, session.source.name, used)
    except Exception:  # the model did not resolve: the tests already said why
        orphaned = []
    if orphaned:
        lines.append(f"baselines orphaned (no tested build used them): {', '.join(str(p) for p in orphaned)}")
    return lines


def result_lines(collected: Collected) -> list[str]:
    """The report module's summary lines when it is installed, else one line per failed result."""
    try:
        from ..report import summary_lines

        return list(summary_lines(collected.results, report_dir=collected.report_path))
    except ImportError:
        pass
    failed = [r for r in collected.results if not r["passed"]]
    lines = [f"gate: {len(collected.results) - len(failed)} of {len(collected.results)} invariant checks passed"]
    lines += [f"  FAILED {r['build']} {r['invariant']} against the {r['against']}" for r in failed]
    return lines


def terminal_summary(terminalreporter, session, collected: Collected) -> None:
    """The ``circuits`` section of the terminal summary."""
    terminalreporter.section("circuits")
    for line in collected.notes + baseline_lines(session, collected) + result_lines(collected):
        terminalreporter.write_line(line)
    if collected.report_path is not None:
        terminalreporter.write_line(f"report: {collected.report_path}")


def write_report(session, collected: Collected) -> None:
    """``--circuits-report DIR``: the report module's HTML page; a missing module is one line."""
    if session.settings.report is None:
        return
    try:
        from ..report import write_report as write
    except ImportError as error:
        collected.notes.append(f"--circuits-report: the report module is unavailable ({error})")
        return
    try:
        collected.report_path = write(session.settings.report, list(collected.records.values()),
                                      collected.references, collected.results)
    except Exception as error:  # the gate's verdict stands even if drawing fails
        collected.notes.append(f"--circuits-report: writing the report failed: {type(error).__name__}: {error}")
