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
from pytest_circuits.report import (
    REPORT_PAGE,
    SUMMARY_PAGE,
    data,
    report_command,
    report_from_files,
    summary_lines,
    write_report,
)

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
    assert "`copying_heads` (bnb-nf4)" in summary and "| **FAIL** | bnb-nf4 | copying_heads |" in summary
    assert all(f"]({p.name})" in summary for p in pngs)


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
    from pytest_circuits.report import figures, sections

    reference, candidate, _ = sabotaged(seed=2)
    fig = figures.eigenvalue_figure(candidate, "t")
    (points,) = [c for c in fig.axes[0].collections if len(c.get_offsets()) > 1]
    plotted = sorted(map(tuple, np.round(points.get_offsets(), 9)))
    expected = []
    for pairs in candidate["eigenvalues"].values():
        lam = np.array([complex(a, b) for a, b in pairs])
        lam = lam / np.abs(lam).max()
        expected += [(round(z.real, 9), round(z.imag, 9)) for z in lam]
    assert plotted == sorted(expected)
    assert np.abs(points.get_offsets()).max() <= 1 + 1e-12

    heat = figures.heatmap_figure(sections._panels(candidate), "t")
    for ax, (column, _, _) in zip([a for a in heat.axes if a.images], data.HEATMAP_METRICS):
        shown = ax.images[0].get_array()
        for h in candidate["heads"]:
            assert shown[h["layer"], h["head_index"]] == pytest.approx(h[column])
    assert figures.png_bytes(heat)[:8] == PNG_MAGIC


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
    assert capsys.readouterr().out.strip().endswith(str(out / REPORT_PAGE))
    text = (out / REPORT_PAGE).read_text()
    assert "No gate verdicts" in text and "differences against the reference (fp32)" in text
    assert "<td>L1H2</td><td>kappa</td>" in text  # the flipped head leads the descriptive changes
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
