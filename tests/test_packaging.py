"""The wheel carries the gate suite, the embedded model and its baselines: `pytest --pyargs
pytest_circuits.probes` passes from an empty folder with only the installed wheel."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pytest_circuits.gate.invariants import per_build_invariants

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_installed_wheel_runs_the_gate_suite(tmp_path):
    wheels, site, empty = tmp_path / "wheels", tmp_path / "site", tmp_path / "project"
    empty.mkdir()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("pytest_circuits-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in (
        "pytest_circuits/py.typed",
        "pytest_circuits/probes/test_rung1_weights.py",
        "pytest_circuits/baselines/tiny-induction--fp32.json",
        "pytest_circuits/models/tiny-induction/model.safetensors",
        "pytest_circuits/examples/tiny-induction-audit.jsonl",  # the audit slice docs/audit.md gates
    ):
        assert shipped in names
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        timeout=600,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "pytest_circuits.probes",
            "-p",
            "no:cacheprovider",
            "--circuits-builds",
            "fp32",
            "-q",
        ],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        f"{len(per_build_invariants())} passed" in done.stdout  # one test per invariant of one build
        and str(site)
        in subprocess.run(
            [sys.executable, "-c", "import pytest_circuits; print(pytest_circuits.__file__)"],
            cwd=empty,
            env=env,
            capture_output=True,
            text=True,
        ).stdout
    )


@pytest.mark.slow
def test_the_update_hint_pastes_from_an_installed_wheel(tmp_path):
    """``pytest --pyargs pytest_circuits.probes`` from a wheel: the failure's hint, pasted, records."""
    from .test_plugin import paste_the_update_hint

    site = installed_wheel(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    paste_the_update_hint(work, "pyargs", site)


def installed_wheel(tmp_path: Path) -> Path:
    """This checkout built as a wheel and installed into a folder of its own (put it on PYTHONPATH)."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("pytest_circuits-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        timeout=600,
    )
    return site


def _readme_circuits_lines() -> list[str]:
    """Every ``circuits`` command of the README's bash blocks."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return [line.split("  #")[0].strip() for b in blocks for line in b.splitlines() if line.startswith("circuits ")]


@pytest.mark.slow
def test_the_readme_runs_from_a_wheel_outside_a_clone(tmp_path):
    """From an installed wheel, in a folder beside the one it is installed in (their common parent holds
    a corrupt baselines/ a wrong default would read): each README ``circuits`` line exits 0, and the
    gate suite under --pyargs with no ini file reads ./baselines or the shipped ones, never the parent's."""
    site = installed_wheel(tmp_path)
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "tiny-induction--fp32.json").write_text("{}")  # the common parent's, not ours
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    lines = _readme_circuits_lines()
    assert any(" --baseline " in line for line in lines)
    for line in lines:
        words = shlex.split(line)
        done = subprocess.run(
            [sys.executable, "-m", "pytest_circuits.cli", *words[1:]],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, f"{line}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "pytest_circuits.probes", "-p", "no:cacheprovider"]
        + ["--circuits-builds", "fp32", "-q", "-k", "copy_loss"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert str(site) in done.stdout and str(tmp_path / "baselines") not in done.stdout
