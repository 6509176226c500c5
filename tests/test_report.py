"""The circuits report: self-contained HTML, summary.md, PNG figures, terminal summary, from files."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pytest

from pytest_circuits.errors import BaselineError, CircuitsError
from pytest_circuits.gate.invariants import gate_all
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.report import (
    REPORT_PAGE,
    SUMMARY_PAGE,
    data,
    report_command,
    report_from_files,
    summary_lines,
    write_report,
)
from pytest_circuits.testing import has_embedded_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
INDUCTION, PREVIOUS = (1, 2), (0, 1)


def kappa_of(lam: np.ndarray) -> float:
    """kappa = mean over eigenvalues of Re/|.|, 0 where |lambda| <= 1e-6 max|lambda| (DEFINITIONS.md)."""
    mag = np.abs(lam)
    f = np.where(mag > 1e-6 * mag.max(), lam.real / np.where(mag > 0, mag, 1), 0.0)
    return float(f.mean())


def fake_record(
    recipe="fp32", n_layers=2, n_heads=4, d_head=8, seed=0, knockouts=True, flip=(), dtype="float32", eigenvalues=True
):
    """A scan record that follows the contract: a copying induction head, a previous-token head.

    Heads in ``flip`` have their OV eigenvalues negated (kappa flips sign, copying -> suppression).
    """
    rng = np.random.default_rng(seed)
    heads, eig = [], {}
    for layer in range(n_layers):
        for index in range(n_heads):
            label = f"L{layer}H{index}"
            lam = rng.normal(size=d_head) + 1j * rng.normal(size=d_head)
            if (layer, index) == INDUCTION:
                lam = np.abs(lam.real) * 3 + 0.3j * lam.imag  # copying: right half-plane
            if (layer, index) in flip:
                lam = -lam
            lam = lam * rng.uniform(0.5, 20)
            kappa = kappa_of(lam)
            null_sd = 1 / math.sqrt(2 * d_head)
            z = kappa / null_sd
            ko = float(rng.normal(0, 0.02)) + (1.5 if (layer, index) == INDUCTION else 0.0)
            heads.append(
                {
                    "head": label,
                    "layer": layer,
                    "head_index": index,
                    "kappa": kappa,
                    "kappa_uncentred": kappa,  # a fake record: one W_U, no vocabulary mean
                    "kappa_trace": float(lam.real.sum() / np.abs(lam).sum()),
                    "kappa_null_mean": 0.0,
                    "kappa_null_sd": null_sd,
                    "kappa_z": z,
                    "kappa_p": float(math.erfc(abs(z) / math.sqrt(2))),
                    "kappa_q": float(math.erfc(abs(z) / math.sqrt(2))),
                    "copying": bool(z > 3),
                    "suppression": bool(z < -3),
                    "prefix_matching": 0.9 if (layer, index) == INDUCTION else float(rng.uniform(0, 0.1)),
                    "previous_token": 0.85 if (layer, index) == PREVIOUS else float(rng.uniform(0, 0.2)),
                    "duplicate_token": float(rng.uniform(0, 0.1)),
                    "knockout_delta": ko if knockouts else None,
                }
            )
            eig[label] = [[float(x.real), float(x.imag)] for x in lam]
    return {
        "schema_version": 1,
        "model": {
            "name": "fake-model",
            "spec": "fake-model",
            "family": "gpt2",
            "fingerprint": "ab" * 32,
            "geometry": {
                "n_layers": n_layers,
                "n_heads": n_heads,
                "n_kv_heads": n_heads,
                "d_model": n_heads * d_head,
                "d_head": d_head,
                "vocab": 512,
            },
        },
        "build": {"recipe": recipe, "dtype": dtype, "backend": "torch", "backend_version": "2.13", "device": "cpu"},
        "versions": {"torch": "2.13", "transformers": "5.24", "bitsandbytes": None, "pytest_circuits": "0.1.0"},
        "probe": {"seed": 0, "n": 8, "L": 64, "bos_id": None, "vocab_size": 512, "n_special": 0},
        "knockout": {"seed": 1, "mode": "zero", "n": 8, "L": 64, "screened": False} if knockouts else None,
        "rung1": {
            "n_rotations": 256,
            "q": 0.05,
            "folded": True,
            "analytic_floor": 1 / math.sqrt(2 * d_head),
            "null_sd_median": 1 / math.sqrt(2 * d_head),
        },
        "copy_loss": 0.4 + 0.01 * seed,
        "first_copy_loss": 6.1,
        "copy_gain": 5.7 - 0.01 * seed,
        "uniform_loss": math.log(512),
        "heads": heads,
        "eigenvalues": eig if eigenvalues else {},
    }


@dataclass
class Result:
    """A stand-in with the InvariantResult contract (the report also takes plain dicts)."""

    invariant: str
    build: str
    against: str
    passed: bool
    message: str = ""
    moved: list = field(default_factory=list)

    def as_dict(self):
        return asdict(self)


def sabotaged(seed=0):
    """fp32 reference, and an nf4 build (same weights) whose induction head L1H2 was negated."""
    reference = fake_record("fp32", seed=seed)
    candidate = fake_record("bnb-nf4", seed=seed, flip=(INDUCTION,), dtype="nf4")
    before, after = reference["heads"][6]["kappa"], candidate["heads"][6]["kappa"]
    results = [
        Result(
            "copying_heads",
            "bnb-nf4",
            "fp32 baseline",
            False,
            f"copying heads lost: L1H2 kappa {before:.3f} -> {after:.3f}",
            [{"head": "L1H2", "metric": "kappa", "before": before, "after": after, "tolerance": 0.1}],
        ),
        Result("copy_loss", "bnb-nf4", "fp32 baseline", True, "copy loss within tolerance"),
    ]
    return reference, candidate, results


def external_links(page: str) -> list[str]:
    """Every src/href/url() target that is not a data: URI or an in-page anchor."""
    targets = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]*)""", page, flags=re.I)
    targets += re.findall(r"url\(\s*['\"]?([^'\")]*)", page, flags=re.I)
    return [t for t in targets if not (t.startswith("data:") or t.startswith("#"))]


def verdict_rows(page: str) -> list[tuple[str, str, str]]:
    """``(status, invariant, against)`` of every row of the page's verdict tables, in order."""
    words = {"pass": "passed", "FAIL": "failed", "skip": "skipped"}
    rows = re.findall(r"<tr><td class=(\w+)>\w+</td><td>([^<]+)</td><td>[^<]+</td><td>([^<]*)</td>", page)
    return [(words[status], invariant, against) for status, invariant, against in rows]


def test_html_is_self_contained_and_names_the_broken_invariant(tmp_path):
    reference, candidate, results = sabotaged()
    page = write_report(tmp_path, [reference, candidate], {"bnb-nf4": reference}, results)

    assert page == tmp_path / REPORT_PAGE and page.is_file()
    text = page.read_text(encoding="utf-8")
    assert external_links(text) == []
    assert not re.search(r"https?://", text)
    assert "<script" not in text.lower() and "<link" not in text.lower()
    images = re.findall(r'<img src="([^"]+)"', text)
    assert images and all(src.startswith("data:image/png;base64,") for src in images)
    assert all(base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC) for src in images)
    # the broken invariant is named in the banner, before the first build section
    top = text[: text.index('<h2 id="')]
    assert "copying_heads" in top and "bnb-nf4" in top and "copy_loss" not in top
    assert "1 of 2 invariants broken" in top
    # the figures beside summary.md are the ones embedded in the page
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == len(images)
    assert {base64.b64encode(p.read_bytes()).decode() for p in pngs} == {s.split(",", 1)[1] for s in images}
    assert "bnb-nf4-differences.png" in {p.name for p in pngs}
    assert "bnb-nf4-moved-heads.png" in {p.name for p in pngs}
    summary = (tmp_path / SUMMARY_PAGE).read_text()
    assert "`copying_heads` (bnb-nf4 vs " in summary and "| **FAIL** | bnb-nf4 | copying_heads |" in summary
    # a CI step summary shows neither relative images nor data: URIs: each PNG is named, and where it is
    assert not re.search(r"!\[[^\]]*\]\(", summary) and "data:image" not in summary and "<img" not in summary
    assert all(f"`{p.name}`" in summary for p in pngs)
    assert f"report folder `{tmp_path.name}/`" in summary and "artifact" in summary
    # what broke is listed open; what held folds away
    assert summary.index("| **FAIL** | bnb-nf4 | copying_heads |") < summary.index("<details><summary>1 held</summary>")
    assert summary.index("<details><summary>1 held</summary>") < summary.index("| pass | bnb-nf4 | copy_loss |")


def test_figures_render_without_a_display_or_pyplot(tmp_path):
    reference, candidate, _ = sabotaged()
    ref_file, cand_file = tmp_path / "fp32.json", tmp_path / "nf4.json"
    ref_file.write_text(json.dumps(reference))
    cand_file.write_text(json.dumps(candidate))
    script = (
        "import sys, pytest_circuits, pytest_circuits.report\n"
        "assert 'matplotlib' not in sys.modules, 'importing the package imported matplotlib'\n"
        "from pytest_circuits.report import report_from_files\n"
        f"report_from_files({str(tmp_path / 'out')!r}, {str(cand_file)!r}, {str(ref_file)!r})\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'the report imported pyplot'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "MPLBACKEND")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pngs = list((tmp_path / "out").glob("*.png"))
    assert len(pngs) == 5  # eigenvalues, kappa, per-head maps, differences, moved heads
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)


def test_missing_knockouts_and_eigenvalues_do_not_break_it(tmp_path):
    reference = fake_record("fp32", knockouts=False, eigenvalues=False)
    candidate = fake_record("bf16", seed=3, knockouts=False)
    for h in candidate["heads"]:
        del h["knockout_delta"]  # absent, not just None
    results = [
        {
            "invariant": "knockout_deltas",
            "build": "bf16",
            "against": "fp32 baseline",
            "passed": True,
            "message": "",
            "moved": [{"head": "L0H0", "metric": "knockout_delta", "before": None, "after": None, "tolerance": None}],
        }
    ]
    page = write_report(tmp_path, [reference, candidate], {"bf16": reference}, results)
    text = page.read_text()
    assert "no head knockouts" in text and "carries no eigenvalues" in text
    assert "All 1 invariants held" in text
    assert not (tmp_path / "fp32-eigenvalues.png").exists()
    assert (tmp_path / "bf16-eigenvalues.png").read_bytes()[:8] == PNG_MAGIC
    assert not data.has_metric(candidate, "knockout_delta")
    assert np.isnan(data.metric_grid(candidate, "knockout_delta")).all()


def test_grids_and_differences_match_a_direct_computation():
    reference, candidate, _ = sabotaged(seed=5)
    for column in ("kappa", "prefix_matching", "previous_token", "knockout_delta"):
        grid = data.metric_grid(candidate, column)
        diff = data.difference_grid(candidate, reference, column)
        assert grid.shape == (2, 4)
        for h_ref, h in zip(reference["heads"], candidate["heads"]):
            assert grid[h["layer"], h["head_index"]] == h[column]
            assert diff[h["layer"], h["head_index"]] == pytest.approx(h[column] - h_ref[column])
    # negating the induction head's eigenvalues flips its kappa; it is the largest change
    top = data.largest_changes(candidate, reference, k=1)[0]
    assert (top["head"], top["metric"]) == ("L1H2", "kappa")
    assert top["after"] == pytest.approx(-top["before"]) and top["before"] > 0.5
    # eigenvalues are normalised per head by their own max |lambda|
    normalised = data.normalised_eigenvalues(candidate)
    for label, pairs in candidate["eigenvalues"].items():
        lam = np.array([complex(re_, im) for re_, im in pairs])
        np.testing.assert_allclose(normalised[label], lam / max(abs(lam)))
    assert data.difference_grid(candidate, fake_record(n_layers=3), "kappa") is None


def test_figures_plot_the_records_numbers():
    from pytest_circuits.report import plots, sections

    reference, candidate, _ = sabotaged(seed=2)
    fig = plots.eigenvalue_figure(candidate, "t")
    (points,) = [c for c in fig.axes[0].collections if len(c.get_offsets()) > 1]
    plotted = sorted(map(tuple, np.round(points.get_offsets(), 9)))
    expected = []
    for pairs in candidate["eigenvalues"].values():
        lam = np.array([complex(a, b) for a, b in pairs])
        lam = lam / np.abs(lam).max()
        expected += [(round(z.real, 9), round(z.imag, 9)) for z in lam]
    assert plotted == sorted(expected)
    assert np.abs(points.get_offsets()).max() <= 1 + 1e-12

    heat = plots.heatmap_figure(sections._panels(candidate), "t")
    for ax, (column, _, _) in zip([a for a in heat.axes if a.images], data.HEATMAP_METRICS):
        shown = ax.images[0].get_array()
        for h in candidate["heads"]:
            assert shown[h["layer"], h["head_index"]] == pytest.approx(h[column])
    assert plots.png_bytes(heat)[:8] == PNG_MAGIC


def test_reference_with_another_head_grid_is_noted_not_drawn(tmp_path):
    page = write_report(tmp_path, [fake_record("bf16")], {"bf16": fake_record("fp32", n_layers=3)})
    assert "different head grid" in page.read_text()
    assert not (tmp_path / "bf16-differences.png").exists()


def test_terminal_summary_ranks_moved_heads_by_change_over_tolerance():
    moved = [
        {"head": "L0H1", "metric": "prefix_matching", "before": 0.9, "after": 0.7, "tolerance": 0.05},  # 4x
        {"head": "L1H2", "metric": "kappa", "before": 0.6, "after": -0.5, "tolerance": 0.1},  # 11x
        {"head": "L1H3", "metric": "kappa", "before": 0.2, "after": 0.25, "tolerance": 0.1},  # 0.5x
        {"head": "L0H0", "metric": "kappa", "before": 0.1, "after": 0.4, "tolerance": None},  # 0.3 raw
    ]
    results = [
        Result("copying_heads", "bnb-nf4", "fp32 baseline", False, "\n copying heads lost: L1H2\nmore", moved),
        Result("copy_loss", "bnb-nf4", "fp32 baseline", True),
        {"invariant": "copy_loss", "build": "bf16", "against": "fp32 baseline", "passed": True, "moved": []},
    ]
    lines = summary_lines(results, [fake_record("fp32"), fake_record("bf16")], "out/rep")
    assert lines[0] == "circuits bnb-nf4 vs fp32 baseline: FAIL (1 of 2 invariants broken)"
    assert lines[1] == "  FAIL copying_heads: copying heads lost: L1H2"
    assert lines[2] == "  pass copy_loss"
    ranked = re.findall(r"(L\dH\d) ", lines[3])
    assert lines[3].startswith("  moved most: ") and ranked == ["L1H2", "L0H1", "L1H3"]
    assert lines[4] == "circuits bf16 vs fp32 baseline: pass (1 invariant held)"
    assert lines[5] == "  pass copy_loss"
    assert lines[6] == "circuits fp32: scanned, not gated (copy loss 0.400 nats)"
    assert lines[-1] == f"circuits report: {os.path.join('out', 'rep', REPORT_PAGE)}"
    assert len(lines) == 8


def test_report_command_draws_again_from_baseline_files(tmp_path, capsys):
    reference, candidate, _ = sabotaged()
    reference["file_version"], candidate["file_version"] = 1, 1  # file-level keys beside the record
    ref_file, cand_file = tmp_path / "fp32.json", tmp_path / "nf4.json"
    ref_file.write_text(json.dumps(reference))
    cand_file.write_text(json.dumps(candidate))
    out = tmp_path / "again"
    assert report_command([str(cand_file), "--against", str(ref_file), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"circuits report: {out / REPORT_PAGE}" in printed
    text = (out / REPORT_PAGE).read_text()
    assert "differences against the baseline (fp32)" in text
    assert "<td>L1H2</td><td>kappa</td>" in text  # the flipped head leads the per-head changes
    # gated, not "scanned, not gated": the same verdicts as the one gate flow
    expected = gate_all(reference, candidate, Tolerances(), "bnb-nf4", "baseline fp32.json")
    assert "not gated" not in printed and "No gate verdicts" not in text
    assert verdict_rows(text) == [(r.status, r.invariant, r.against) for r in expected]
    assert "circuits bnb-nf4 vs baseline fp32.json: FAIL" in printed
    assert "no attention map" in text.lower()  # from files there is no model to run: said, not left blank
    # a broken file is one line naming it, through the function and the command
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BaselineError, match="bad.json") as error:
        report_from_files(out, bad)
    assert "\n" not in str(error.value)
    assert report_command([str(tmp_path / "missing.json")]) == 2
    assert "missing.json does not exist" in capsys.readouterr().err  # errors go to stderr


def test_missing_matplotlib_is_one_line_naming_pip_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(CircuitsError, match="pip install matplotlib") as error:
        write_report(tmp_path, [fake_record()])
    assert "\n" not in str(error.value)
    assert summary_lines([], [fake_record()]) == ["circuits fp32: scanned, not gated (copy loss 0.400 nats)"]


def test_summary_says_why_an_invariant_was_skipped():
    """A gate across base models skips the per-head invariants: the summary says why, grouped by
    reason, rather than calling them 'nothing to compare'."""

    from .conftest import SHIPPED_BASELINES as root

    before, after = (json.loads((root / f"{m}--fp32.json").read_text()) for m in ("smollm2-135m", "tiny-induction"))
    results = gate_all(before, after, Tolerances(), "fp32", "smollm2-135m baseline")
    skipped = [r.invariant for r in results if r.skipped]
    assert {"copying_heads", "knockout_deltas", "copy_loss"} <= set(skipped)
    text = "\n".join(summary_lines(results))
    assert "nothing to compare" not in text
    per_head = [line for line in text.splitlines() if "per-head invariants are not compared across models" in line]
    assert len(per_head) == 1 and per_head[0].startswith("  skip copying_heads, kappa_distribution")
    assert "geometry n_layers 30 vs 2" in per_head[0] and "knockout_deltas" in per_head[0]


@pytest.mark.slow
def test_smollm2_sized_records_render(tmp_path):
    """30 layers x 9 heads, d_head 64, with a gated comparison: the size of SmolLM2-135M."""
    shape = dict(n_layers=30, n_heads=9, d_head=64)
    reference = fake_record("fp32", **shape)
    candidate = fake_record("bnb-nf4", seed=1, **shape)
    start = time.perf_counter()
    page = write_report(tmp_path, [reference, candidate], {"bnb-nf4": reference})
    seconds = time.perf_counter() - start
    print(f"30x9-head report, 2 builds, {len(list(tmp_path.glob('*.png')))} figures: {seconds:.1f} s")
    assert page.stat().st_size > 0
    assert data.metric_grid(candidate, "kappa").shape == (30, 9)
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in tmp_path.glob("*.png"))


# ---------------------------------------------------------------- what broke first, what did not move folded


def section_order(page: str) -> list[str]:
    return re.findall(r'<h2 id="([^"]+)">Build ', page)


def test_failing_builds_come_first_and_the_reference_against_itself_folds(tmp_path):
    reference, candidate, results = sabotaged()
    # the reference gated against its own baseline: the same figures, up to the baselines' 6-digit rounding
    from pytest_circuits.record.store import round_sig

    own = round_sig(reference)
    results = [*results, Result("copy_loss", "fp32", "fp32 baseline", True, "copy loss within tolerance")]
    page = write_report(tmp_path, [reference, candidate], {"fp32": own, "bnb-nf4": reference}, results)
    text = page.read_text()
    assert section_order(text) == ["bnb-nf4", "fp32"]  # given fp32 first; the broken build leads
    assert "Builds (broken first)" in text
    summary = (tmp_path / SUMMARY_PAGE).read_text()
    assert summary.index("| bnb-nf4 | nf4 |") < summary.index("| fp32 | float32 |")
    lines = summary_lines([results[-1], *results[:2]], report_dir=tmp_path)
    assert lines[0].startswith("circuits bnb-nf4 vs fp32 baseline: FAIL")
    # fp32 against itself: its all-zero difference maps fold behind one line, nothing listed as changed
    fp32 = text[text.index('<h2 id="fp32">') :]
    folded = re.findall(r'<details class="fold"><summary>([^<]+)</summary>(.*?)</details>', text, flags=re.S)
    assert len(folded) == 1
    note, hidden = folded[0]
    assert "fp32" in note and "all zero" in note and "fp32: differences against the baseline (fp32)" in hidden
    assert 'class="fold"' in fp32 and "Largest per-head changes" not in fp32
    # the sabotaged build's maps stay open, its changes listed
    nf4 = text[text.index('<h2 id="bnb-nf4">') : text.index('<h2 id="fp32">')]
    assert 'class="fold"' not in nf4 and "Largest per-head changes" in nf4
    assert "(the difference maps are all zero" not in summary and "all zero" in summary


def test_eigenvalue_close_ups_show_the_flagged_figure_of_heads_flagged_on_kappa():
    from pytest_circuits.report import plots, sections

    reference, candidate, _ = sabotaged()
    trace_before, trace_after = reference["heads"][6]["kappa_trace"], candidate["heads"][6]["kappa_trace"]
    moved = [
        {"head": "L1H2", "metric": "kappa_trace", "before": trace_before, "after": trace_after, "tolerance": 0.15},
        {"head": "L0H1", "metric": "prefix_matching", "before": 0.9, "after": 0.2, "tolerance": 0.1},  # not kappa
        {"head": "L0H3", "metric": "kappa_z", "before": 1.729, "after": 1.729, "tolerance": 1.0},  # did not move
    ]
    results = [data.result_dict(Result("copying_heads", "bnb-nf4", "fp32 baseline", False, "moved", moved))]
    section = sections.Section("bnb-nf4", "bnb-nf4", candidate, reference, results)
    flagged = sections.kappa_flagged(section)
    assert [(m["head"], m["metric"]) for m in flagged] == [("L1H2", "kappa_trace")]
    fig = plots.moved_eigenvalue_figure(candidate, reference, flagged, "t")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [f"L1H2  κ_trace {data.fmt(trace_before, 2)} → {data.fmt(trace_after, 2)}"]
    # a head flagged on two κ figures: the one that moved furthest, the other under it
    kappa_row = {"head": "L1H2", "metric": "kappa", "before": 0.9, "after": 0.85, "tolerance": 0.15}
    section.results = [
        data.result_dict(Result("copying_heads", "bnb-nf4", "fp32 baseline", False, "", [*moved, kappa_row]))
    ]
    (both,) = sections.kappa_flagged(section)
    assert both["metric"] == "kappa_trace" and [m["metric"] for m in both["also"]] == ["kappa"]
    fig = plots.moved_eigenvalue_figure(candidate, reference, [both], "t")
    assert fig.axes[0].get_title().endswith("\nκ 0.90 → 0.85")
    other = {"head": "L0H0", "metric": "kappa", "before": 0.5, "after": -0.5, "tolerance": 0.15, "also": []}
    fig = plots.moved_eigenvalue_figure(candidate, reference, [both, other], "t")
    assert [ax.get_title().split()[0] for ax in fig.axes] == ["L1H2", "L0H0"]
    # the boxes of the difference maps follow the figure each names
    assert sections._outline(section, "kappa") == {(1, 2)}
    assert sections._outline(section, "prefix_matching") == {(0, 1)}
    assert sections._outline(section, "knockout_delta") == set()
    # no kappa row: no close-up at all
    section.results = [data.result_dict(Result("induction_heads", "bnb-nf4", "fp32 baseline", False, "", moved[1:2]))]
    assert sections.kappa_flagged(section) == []


def test_unmeasured_knockouts_are_hatched_with_a_legend_never_zero(tmp_path):
    from matplotlib.collections import PatchCollection

    from pytest_circuits.report import plots, sections

    screened = fake_record("fp32", seed=1)
    kept = {"L1H2", "L0H1"}  # a screened scan measured these exactly; the rest have no knockout
    for h in screened["heads"]:
        if h["head"] not in kept:
            h["knockout_delta"] = None
    screened["knockout"]["screened"] = 2
    fig = plots.heatmap_figure(sections._panels(screened), "t")
    knockout_ax = [a for a in fig.axes if a.images][-1]
    assert knockout_ax.get_title() == "knockout Δloss (nats)"
    shown = knockout_ax.images[0].get_array()
    assert shown.mask.sum() == 6 and not shown.mask[1, 2] and not shown.mask[0, 1]  # masked, not 0
    (hatched,) = [c for c in knockout_ax.collections if isinstance(c, PatchCollection)]
    corners = {tuple(np.round(p.vertices.min(axis=0) + 0.5).astype(int)) for p in hatched.get_paths()}
    assert corners == {(h["head_index"], h["layer"]) for h in screened["heads"] if h["head"] not in kept}
    assert all(hatch == "////" for hatch in [hatched.get_hatch()])
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["not measured (screened out: no exact knockout)"]
    # fully measured maps carry no legend and no hatching
    full = plots.heatmap_figure(sections._panels(fake_record("fp32")), "t")
    assert full.legends == [] and not any(isinstance(c, PatchCollection) for a in full.axes for c in a.collections)
    page = write_report(tmp_path, [screened]).read_text()
    assert "Hatched grey cells were not measured" in page


def test_long_head_lists_fold_and_failure_text_wraps(tmp_path):
    many = fake_record("fp32", n_layers=4, n_heads=8, d_head=4)
    for h in many["heads"][:20]:
        h["copying"] = True
    failing = Result("copy_loss", "fp32", "fp32 baseline", False, "x" * 400 + "\n" + "a very long line " * 40)
    page = write_report(tmp_path, [many], results=[failing]).read_text()
    names = ", ".join(h["head"] for h in many["heads"][:20])
    assert f"<details><summary>20 heads (L0H0, L0H1, L0H2, L0H3, L0H4, L0H5, …)</summary>{names}</details>" in page
    few = write_report(tmp_path / "few", [fake_record("fp32")]).read_text()
    assert "<details><summary>" not in few and "<th>copying heads</th><td>L1H2</td>" in few
    # long lines in <pre> wrap instead of overflowing the page
    style = re.search(r"pre \{([^}]*)\}", page)[1]
    assert "white-space: pre-wrap" in style and "overflow-wrap: anywhere" in style and "overflow-x" not in style
    assert "<pre>" + "x" * 400 in page


# ---------------------------------------------------------------- circuits report --against: the gate's verdicts


@pytest.mark.skipif(not has_embedded_model(), reason="embedded model missing: python scripts/train_tiny_induction.py")
def test_report_against_shows_the_verdicts_of_circuits_gate_and_diff(tmp_path, capsys):
    from pytest_circuits import cli
    from pytest_circuits.model.named import SHIPPED_BASELINES

    build, reference = (
        SHIPPED_BASELINES / "tiny-induction--rtn-int4.json",
        SHIPPED_BASELINES / "tiny-induction--fp32.json",
    )
    assert cli.main(["report", str(build), "--against", str(reference), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert cli.main(["diff", str(reference), str(build)]) == 0
    diffed = capsys.readouterr().out
    verdict_line = next(l for l in diffed.splitlines() if l.startswith("with default tolerances"))
    assert verdict_line.split(": ", 1)[1] in printed  # the same verdict line as circuits diff
    page = (tmp_path / REPORT_PAGE).read_text()
    rows = verdict_rows(page)
    assert rows and all(status == "passed" for status, _, _ in rows) and "not gated" not in printed
    # and the same verdicts as the one gate flow on the two files
    expected = gate_all(json.loads(reference.read_text()), json.loads(build.read_text()), Tolerances(), "rtn-int4", "")
    assert [(status, invariant) for status, invariant, _ in rows] == [(r.status, r.invariant) for r in expected]


@pytest.mark.slow
@pytest.mark.skipif(not has_embedded_model(), reason="embedded model missing: python scripts/train_tiny_induction.py")
def test_report_against_matches_circuits_gate_on_the_model(tmp_path, capsys):
    """``circuits gate`` scans the build live (about 15 s); its verdict per invariant is the report's."""
    from pytest_circuits import cli
    from pytest_circuits.model.named import SHIPPED_BASELINES

    build, reference = (
        SHIPPED_BASELINES / "tiny-induction--rtn-int4.json",
        SHIPPED_BASELINES / "tiny-induction--fp32.json",
    )
    assert cli.main(["report", str(build), "--against", str(reference), "--out", str(tmp_path)]) == 0
    rows = verdict_rows((tmp_path / REPORT_PAGE).read_text())
    capsys.readouterr()
    assert cli.main(["gate", "tiny-induction", "--build", "rtn-int4", "--baseline", str(reference)]) == 0
    gated = capsys.readouterr().out
    words = {word: status for status, word in cli.STATUS_WORDS.items()}
    live = {inv: words[word] for word, inv in re.findall(r"^(PASS|FAIL|SKIP) (\w+): ", gated, flags=re.M)}
    assert live and live == {invariant: status for status, invariant, _ in rows}


# ---------------------------------------------------------------- the two pictures: loss per position, attention


@pytest.fixture(scope="module")
def embedded_fp32():
    """tiny-induction's fp32 build scanned on a small probe (no knockouts), with its session."""
    if not has_embedded_model():
        pytest.skip("embedded model missing: python scripts/train_tiny_induction.py")
    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.repeat_settings import RepeatSettings
    from pytest_circuits.settings import CircuitsSettings

    session = Run(CircuitsSettings(model="tiny-induction", device="cpu", probe=RepeatSettings(3, 4, 24)))
    return session, session.records.record("fp32", knockout=False).data


def test_position_loss_is_the_models_own_per_position_loss(embedded_fp32):
    """The stored and plotted curve equals CE_t recomputed from the model's logits (float64 log-softmax)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pytest_circuits.record.store import validate
    from pytest_circuits.report import plots
    from pytest_circuits.rungs.repeat import repeat_tokens

    session, record = embedded_fp32
    L, o = 24, (0 if session.loaded.build("fp32").tokens.bos_id is None else 1)
    model = AutoModelForCausalLM.from_pretrained(
        session.loaded.source.folder, dtype=torch.float32, attn_implementation="eager"
    )
    ids = repeat_tokens(session.loaded.build("fp32").tokens, 4, L, 3)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.double(), dim=-1)
    t = np.arange(1, 2 * L)  # CE_t: predicting position o+t from the logits at o+t-1
    ce = -logp[:, o + t - 1, :].gather(-1, ids[:, o + t].unsqueeze(-1)).squeeze(-1).numpy()
    expected = ce.mean(axis=0)
    assert len(record["position_loss"]) == 2 * L - 1
    np.testing.assert_allclose(record["position_loss"], expected, rtol=1e-4, atol=1e-5)
    # it is the curve the model figures average: copy loss over t = L+1..2L-1, first copy over 1..L-1
    assert np.mean(expected[L:]) == pytest.approx(record["copy_loss"], rel=1e-4)
    assert np.mean(expected[: L - 1]) == pytest.approx(record["first_copy_loss"], rel=1e-4)
    # the signature of copying: first copy near ln V, second copy far below it
    assert abs(np.mean(expected[: L - 1]) - record["uniform_loss"]) < 1.0 and np.mean(expected[L:]) < 1.0
    fig = plots.position_loss_figure([("fp32", record)], "t")
    (curve,) = [line for line in fig.axes[0].lines if line.get_label() == "fp32"]
    np.testing.assert_allclose(curve.get_xdata(), t)
    np.testing.assert_allclose(curve.get_ydata(), expected, rtol=1e-4, atol=1e-5)
    # optional in the schema: a record with it validates, one of the wrong length is one line, older ones lack it
    validate(record, "scan")
    broken = {**record, "position_loss": record["position_loss"][:-1]}
    with pytest.raises(BaselineError, match=f"position_loss holds {2 * L - 2} values") as error:
        validate(broken, "scan")
    assert "\n" not in str(error.value)
    validate({k: v for k, v in record.items() if k != "position_loss"}, "scan")


def test_attention_map_is_the_heads_own_pattern_with_the_induction_stripe(embedded_fp32, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from pytest_circuits.plugin.collect import attention_for_report
    from pytest_circuits.report import plots
    from pytest_circuits.rungs.repeat import repeat_tokens

    session, record = embedded_fp32
    attention = attention_for_report(session, "fp32", None)
    head = attention["head"]
    scores = {h["head"]: h["prefix_matching"] for h in record["heads"]}
    assert scores[head] == max(scores.values())  # the strongest induction head
    layer, index = data.cell_of(head)
    model = AutoModelForCausalLM.from_pretrained(
        session.loaded.source.folder, dtype=torch.float32, attn_implementation="eager"
    )
    ids = repeat_tokens(session.loaded.build("fp32").tokens, 1, 24, 3)
    with torch.no_grad():
        expected = model(input_ids=ids, output_attentions=True).attentions[layer][0, index].numpy()
    pattern = np.asarray(attention["pattern"])
    np.testing.assert_allclose(pattern, expected, atol=1e-4)
    assert attention["tokens"] == ids[0].tolist()
    # the induction stripe: from each second-copy token to the token after its first occurrence
    L, o = 24, attention["offset"]
    stripe = [pattern[o + t, o + t - L + 1] for t in range(L, 2 * L)]
    assert np.mean(stripe) > 0.5
    fig = plots.attention_figure([("fp32", attention, record)], "t")
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), pattern)
    assert head in fig.axes[0].get_title()
    # it reaches the page through the plugin's path; without it the page says why
    page = write_report(tmp_path, [record], attention={"fp32": attention}).read_text()
    assert "Attention of " + head in page and "No attention map" not in page
    assert (tmp_path / "attention.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "position-loss.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
@pytest.mark.skipif(not has_embedded_model(), reason="embedded model missing: python scripts/train_tiny_induction.py")
def test_the_plugins_report_has_both_pictures(tmp_path):
    """``pytest --circuits-report`` (about 30 s): the plugin has the builds, so the page carries the
    attention map of the reference baseline's strongest induction head."""
    from pytest_circuits.model.named import SHIPPED_BASELINES

    shipped = json.loads((SHIPPED_BASELINES / "tiny-induction--fp32.json").read_text())
    strongest = max(shipped["heads"], key=lambda h: h["prefix_matching"])["head"]
    pytest.importorskip("matplotlib")
    report = tmp_path / "report"
    command = [sys.executable, "-m", "pytest", "--pyargs", "pytest_circuits.probes", "-q", "-p", "no:cacheprovider"]
    command += ["--circuits-builds", "fp32", "--circuits-report", str(report), "-k", "copy_loss"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    page = (report / REPORT_PAGE).read_text()
    assert f"Attention of {strongest} on probe sequence 0" in page and "No attention map" not in page
    assert "Loss at each position" in page
    assert {"attention.png", "position-loss.png"} <= {p.name for p in report.glob("*.png")}


def test_loss_curves_are_the_builds_then_each_reference_baseline_once(tmp_path):
    from pytest_circuits.report import plots, sections

    reference, candidate, _ = sabotaged()
    older = fake_record("bf16", seed=2)  # recorded before position_loss was stored
    for i, record in enumerate((reference, candidate)):
        record["position_loss"] = list(np.linspace(6.2, 0.1 + i, 2 * 64 - 1))
    stored = {**reference, "position_loss": list(np.full(2 * 64 - 1, 3.0))}
    built = [
        sections.Section(data.build_name_of(r), data.slug(data.build_name_of(r)), r, ref, [])
        for r, ref in ((candidate, stored), (older, stored), (reference, None))
    ]
    curves = sections.loss_curves(built)
    assert [label for label, _ in curves] == ["bnb-nf4", "fp32", "fp32 baseline"]
    fig = plots.position_loss_figure(curves, "t")
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    np.testing.assert_allclose(lines["fp32 baseline"].get_ydata(), stored["position_loss"])
    np.testing.assert_allclose(lines["bnb-nf4"].get_ydata(), candidate["position_loss"])
    assert lines["uniform ln V = 6.24"].get_ydata()[0] == pytest.approx(math.log(512))
    _, notes = sections.overview_figures(built, {})
    assert any("bf16" in n and "position_loss" in n for n in notes)
    # an unmeasured knockout in the gate's rows reads "not measured" on the page, never as a number
    moved = [{"head": "L1H2", "metric": "knockout_delta", "before": 1.5, "after": None, "tolerance": 0.75}]
    page = write_report(tmp_path, [candidate], results=[Result("knockout_deltas", "bnb-nf4", "", False, "", moved)])
    assert "<td class=num>1.500</td><td class=num>not measured</td>" in page.read_text()


def test_a_build_that_could_not_be_gated_leads_the_report(tmp_path):
    """A build whose scan failed (or whose baseline is missing) is what broke: named first, never
    left out while the page says every invariant held."""
    from types import SimpleNamespace

    from pytest_circuits.plugin.collect import gate_for_test
    from pytest_circuits.settings import CircuitsSettings

    class Unloadable:  # a session whose build cannot load: its records source fails, its baselines read
        settings = CircuitsSettings(model="tiny-induction", report=None)

        @property
        def records(self):
            return self

        @property
        def baselines(self):
            return self

        def load(self, build_name):
            from pytest_circuits.record.store import read_baseline

            from .conftest import SHIPPED_BASELINES as shipped

            return read_baseline(shipped / f"tiny-induction--{build_name}.json")

        def stand_in(self):
            fp32 = self.load("fp32")
            return {"model": fp32["model"], "probe": fp32["probe"]}

        def record(self, build_name, knockout=True, method=None, key_heads=False):
            raise CircuitsError(f"{build_name}: the per-head weight read does not reproduce layer 0")

    node = SimpleNamespace(path=tmp_path / "test_gate.py", user_properties=[])
    request = SimpleNamespace(
        node=node, config=SimpleNamespace(rootpath=tmp_path, invocation_params=SimpleNamespace(args=("test_gate.py",)))
    )
    with pytest.raises(CircuitsError):
        gate_for_test(request, Unloadable(), "bnb-nf4", "copy_loss", Tolerances())
    ((key, rows),) = node.user_properties
    assert key == "circuits_results" and json.loads(json.dumps(rows)) == rows  # plain data (xdist)
    held = Result("copy_loss", "fp32", "fp32 baseline", True, "copy loss within tolerance")
    page = write_report(tmp_path, [fake_record("fp32")], results=[held, *rows]).read_text()
    top = page[: page.index('<h2 id="fp32">')]
    assert "1 of 2 invariants broken or not gated" in top and "All " not in top
    assert "<b>bnb-nf4</b>: <b>copy_loss</b> could not be gated: bnb-nf4: the per-head weight read" in top
    assert "<h2>Builds without a scan record</h2>" in top and "<td class=ERROR>ERROR</td>" in top
    lines = summary_lines([held, *rows])
    assert lines[0] == "circuits bnb-nf4: FAIL (1 of 1 invariants broken)"
    assert lines[1].startswith("  ERROR copy_loss: bnb-nf4: the per-head weight read")
    summary = (tmp_path / SUMMARY_PAGE).read_text()
    assert "| **ERROR** | bnb-nf4 | copy_loss |" in summary and "could not be gated for bnb-nf4" in summary


def test_a_pass_with_skips_says_what_was_guarded_and_what_not():
    """A build whose baseline has no induction or key knockout head passes on 3 invariants: every
    verdict line (CLI, terminal summary, summary.md, report banner) says the rest was not guarded."""
    from pytest_circuits.gate.invariants import InvariantResult, verdict
    from pytest_circuits.report import data, markdown, summary_lines
    from pytest_circuits.report.html import _banner

    statuses = {
        "copying_heads": "passed",
        "kappa_distribution": "passed",
        "copy_loss": "passed",
        "induction_heads": "skipped",
        "knockout_deltas": "skipped",
    }
    results = [
        InvariantResult(name, "fp32", "fp32 baseline", status, "" if status == "passed" else "no such head; ...")
        for name, status in statuses.items()
    ]
    said = (
        "guarded: the copying heads, the kappa distribution, the copy loss; "
        "NOT guarded: the induction and previous-token heads, the key knockout heads (skipped)"
    )
    passed, line = verdict(results)
    assert passed and line.endswith(said)
    assert summary_lines(results)[0] == f"circuits fp32 vs fp32 baseline: pass (3 invariants held; {said})"
    dicts = [data.result_dict(r) for r in results]
    assert f"**G{said[1:]}.**" in markdown.summary([], dicts)
    assert f"<b>G{said[1:]}.</b>" in _banner([], dicts)
    held_all = [InvariantResult("copy_loss", "fp32", "fp32 baseline", "passed", "")]
    assert verdict(held_all)[1] == "gate passed (1 of 1 invariants hold)"  # nothing skipped: nothing to add


def test_the_loss_curve_legend_names_the_uniform_loss_once():
    """A live build (ln V = 10.819778...) beside its stored baseline (10.8198): one "uniform ln V" entry."""
    pytest.importorskip("matplotlib")
    from pytest_circuits.report import plots

    curve = {"position_loss": [3.0, 2.0, 1.0], "probe": {"L": 2}}
    curves = [
        ("fp32", {**curve, "uniform_loss": math.log(49999)}),
        ("bnb-int8", {**curve, "uniform_loss": math.log(49999)}),
        ("fp32 baseline", {**curve, "uniform_loss": 10.8198}),
    ]
    fig = plots.position_loss_figure(curves, "loss")
    labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert [label for label in labels if label.startswith("uniform")] == ["uniform ln V = 10.82"]


def test_summary_md_says_against_which_baseline_an_invariant_broke():
    """A build broken against the reference and its own baseline: copy_loss twice, each with its baseline."""
    from pytest_circuits.report import data, markdown

    results = [
        data.result_dict(
            {"invariant": "copy_loss", "build": "b", "against": against, "status": "failed", "message": "x"}
        )
        for against in ("fp32 baseline", "own baseline")
    ]
    first = markdown.summary([], results).splitlines()[2]
    assert first == "**2 of 2 invariants broken:** `copy_loss` (b vs fp32 baseline), `copy_loss` (b vs own baseline)"


def test_circuits_report_validates_each_file_once(tmp_path, record_validations, capsys):
    """``circuits report B --against A`` reads each file once as its typed Record, gates and draws
    those (#39 item 4: before, each file was read and validated three times)."""
    from pytest_circuits.model.named import SHIPPED_BASELINES

    validations = record_validations
    build, reference = (SHIPPED_BASELINES / f"tiny-induction--{b}.json" for b in ("rtn-int4", "fp32"))
    assert report_command([str(build), "--against", str(reference), "--out", str(tmp_path)]) == 0
    assert "gate passed" in capsys.readouterr().out
    assert validations == ["Record", "Record"]


def test_the_drawn_view_reads_a_partial_record_as_far_as_it_goes():
    """`record.drawn.drawn_record`: a head without its cell reads it from its label, in model order; a missing
    part or figure reads as None; a view is its own view."""
    from pytest_circuits.record.drawn import drawn_record

    partial = {
        "build": {"recipe": "int4"},
        "heads": [{"head": "L1H0", "kappa": 0.5}, {"head": "L0H1", "layer": 0, "head_index": 1}],
    }
    view = drawn_record(partial)
    assert drawn_record(view) is view
    assert view.build_name == "int4" and drawn_record({}).build_name == "build"
    assert [(h.head, h.layer, h.head_index) for h in view.heads] == [("L0H1", 0, 1), ("L1H0", 1, 0)]
    assert view.heads[1].figure("kappa") == 0.5 and view.heads[0].figure("kappa") is None
    assert view.info("model", "geometry", "n_layers") is None and view.info("build", "recipe") == "int4"
    assert view.info("build", "recipe", "deeper") is None and view.figure("eigenvalues") is None
