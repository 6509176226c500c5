"""Every code block of the README and of docs/ runs here, so a snippet cannot rot.

Each page is a project: a scratch folder laid out as a clone (``probes/``, ``baselines/``, and
the embedded model copied to ``my-model/`` and ``release/model/``, the folders the pages name as
"your model"). Blocks run in page order:

- a block with ``title="PATH"`` (python, toml, yaml) is written to PATH in the project; a
  GitHub or GitLab workflow also has its ``run:`` / ``script:`` commands run where it stands;
- ``bash`` lines are commands (``&&`` splits them, ``# ...`` is a comment): ``pytest`` and
  ``circuits`` run in the project on this checkout's package; ``pip install`` is resolved for
  real against the installed packages (``--dry-run --no-index``: nothing is downloaded or
  changed) from the clone; ``pip wheel`` builds the wheel;
- a ``console`` block holds commands too big to run here (CPU-hours at 1B-8B, a Slurm cluster, a
  GPU, llm-compressor's own venv): each ``pytest``, ``circuits`` and ``python scripts/*.py`` command in it is
  checked against that command's own ``--help`` (every ``--flag`` it names must exist), so a renamed
  flag still fails here; an untitled YAML fragment that no page holds in full is checked the same way;
- a ``text`` block is generated output (tests/test_docs.py regenerates it); an untagged block
  is a formula and must not look like a command.

Every command must exit as `EXPECTED_EXIT` says (0 unless listed). ``pytest`` commands of the
gate suite run on the builds they name; with none named they run on ``fp32`` alone instead of
the three default builds (`REDUCED`), the only change made to a command.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r'^```(\w*)(?:[ \t]+title="([^"]+)")?[^\n]*\n(.*?)^```[ \t]*$', re.S | re.M)
GENERATED = re.compile(r"^<!-- generated: (\w+).*?^<!-- /generated: \1 -->", re.S | re.M)
COMMAND_WORDS = ("pytest", "circuits", "pip", "python", "import", "from", "mkdocs", "cat")
STAND_INS = ("my-model", "release/model")  # the folders the pages call "your model"
REDUCED = ["--circuits-builds", "fp32"]  # gate suite runs that name no builds, instead of the three defaults
EXPECTED_EXIT = {
    # the embedded model gated as a replacement of SmolLM2: a swap that fails swap_kappa
    "pytest probes -k base_model_swap --circuits-builds fp32 --circuits-swap-baseline baselines/smollm2-135m--fp32.json": 1,
    "circuits gate tiny-induction --build fp32 --baseline baselines/smollm2-135m--fp32.json --across-models": 1,
}
# a few CPU-minutes of scans each (invariants.md: tests/test_own_invariant.py runs its invariant by default)
SLOW_PAGES = {"getting-started.md", "ci.md", "gate.md", "invariants.md", "audit.md"}


@dataclass
class Block:
    lang: str
    title: str | None
    body: str
    generated: bool


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    spans = [m.span() for m in GENERATED.finditer(text)]
    return [
        Block(m.group(1), m.group(2), m.group(3), any(a <= m.start() < b for a, b in spans))
        for m in FENCE.finditer(text)
    ]


def commands(body: str) -> list[str]:
    found = []
    for line in body.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        found.extend(part.strip() for part in line.split(" && ") if part.strip())
    return found


def workflow_commands(block: Block) -> list[str]:
    """The shell commands of a GitHub Actions or GitLab CI file."""
    config = yaml.safe_load(block.body)
    found: list[str] = []
    for job in (config.get("jobs") or config).values():
        if not isinstance(job, dict):
            continue
        for step in job.get("steps", []):
            found.extend(commands(step.get("run", "")))
        for key in ("script", "after_script"):
            for line in job.get(key, []):
                found.extend(commands(line))
    return found


class Project:
    """A scratch folder laid out as a clone; runs a page's commands in it."""

    def __init__(self, folder: Path):
        self.folder = folder
        shutil.copytree(ROOT / "probes", folder / "probes")
        shutil.copytree(ROOT / "baselines", folder / "baselines")
        from pytest_circuits.model.named import EMBEDDED_DIR

        for stand_in in STAND_INS:
            shutil.copytree(EMBEDDED_DIR / "tiny-induction", folder / stand_in)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "PYTEST_ADDOPTS": "-p no:cacheprovider",
            "GITHUB_STEP_SUMMARY": str(folder / "step-summary.md"),
        }
        self.env.pop("PYTEST_XDIST_WORKER", None)

    def write(self, block: Block) -> None:
        path = self.folder / block.title
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.body, encoding="utf-8")
        if block.lang == "python":
            compile(block.body, str(path), "exec")

    def argv(self, command: str) -> tuple[list[str], Path]:
        words = shlex.split(command)
        program, args = words[0], words[1:]
        if program == "pytest":
            gate_suite = "probes" in args or "pytest_circuits.probes" in args or "tests/test_circuits.py" in args
            if gate_suite and not any(a.startswith("--circuits-builds") for a in args):
                args = [*args, *REDUCED]
            return [sys.executable, "-m", "pytest", *args], self.folder
        if program == "circuits":
            return [sys.executable, "-m", "pytest_circuits.cli", *args], self.folder
        if program == "pip" and args[:1] == ["install"]:
            clone = [str(ROOT) + a[1:] if a.startswith(".") and not a.startswith("./") else a for a in args[1:]]
            clone = [str(self.folder / a) if "/" in a and not a.startswith("/") else a for a in clone]
            return [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--dry-run",
                "--no-index",
                "--no-build-isolation",
                *clone,
            ], self.folder
        if program == "pip" and args[:1] == ["wheel"]:
            args = [str(ROOT) if a == "." else a for a in args[1:]]
            return [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", *args], self.folder
        if program == "cat":  # a CI step: a shell line, into the step summary file CI would show
            return ["bash", "-c", command], self.folder
        raise AssertionError(f"no way to run {command!r}: add it to tests/test_doc_blocks.py")

    def run(self, command: str, page: str) -> None:
        if "vendor/" in command:  # the CI jobs install the wheel a project commits under vendor/
            self.vendor()
        argv, cwd = self.argv(command)
        done = subprocess.run(argv, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=1200)
        expected = EXPECTED_EXIT.get(command, 0)
        assert done.returncode == expected, (
            f"{page}: `{command}` exited {done.returncode}, not {expected}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )

    def vendor(self) -> None:
        if not list((self.folder / "vendor").glob("*.whl")):
            self.run("pip wheel --no-deps . -w vendor", "the vendored wheel")


def run_page(page: Path, folder: Path) -> int:
    """Run every block of ``page`` in a project in ``folder``; returns how many blocks ran."""
    project = Project(folder)
    ran = 0
    for block in blocks(page):
        if block.lang == "text":
            assert block.generated, f"{page.name}: a text block that no script generates"
        elif block.lang == "":
            first = block.body.lstrip().split(" ", 1)[0]
            assert first not in COMMAND_WORDS, f"{page.name}: tag the command block ({block.body[:40]!r})"
        elif block.title:
            project.write(block)
            workflow = block.lang == "yaml"
            for command in workflow_commands(block) if workflow else []:
                project.run(command, page.name)
        elif block.lang == "bash":
            for command in commands(block.body):
                project.run(command, page.name)
        elif block.lang == "yaml":  # a fragment of a workflow shown on another page in full, or flag-checked
            assert workflow_fragment_in_full(block) or check_flags(workflow_commands(block), project.env), (
                f"{page.name}: a CI fragment that no page holds in full and that runs no command of ours"
            )
        elif block.lang == "console":
            check_flags(console_commands(block.body), project.env)
        elif block.lang == "python":
            subprocess.run([sys.executable, "-c", block.body], cwd=folder, env=project.env, check=True, timeout=600)
        else:
            raise AssertionError(f"{page.name}: no way to run a {block.lang!r} block")
        ran += 1
    return ran


def check_flags(commands_: list[str], env: dict) -> int:
    """Check each ``pytest``, ``circuits SUB`` and ``python scripts/X.py`` command's ``--flags`` against its ``--help``;
    how many were checked (other programs, ``sbatch`` or ``export``, are left alone)."""
    checked = 0
    for command in commands_:
        words = shlex.split(command)
        if words[0] == "pytest":
            argv = [sys.executable, "-m", "pytest", "--help"]
        elif words[0] == "circuits" and len(words) > 1:
            argv = [sys.executable, "-m", "pytest_circuits.cli", words[1], "--help"]
        elif words[0] == "python" and len(words) > 1 and words[1].startswith("scripts/") and words[1].endswith(".py"):
            argv = [sys.executable, str(ROOT / words[1]), "--help"]
        else:
            continue
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"`{' '.join(argv[1:])}` exited {done.returncode}: {done.stderr[-2000:]}"
        for word in words:
            if word.startswith("--"):
                assert word.split("=")[0] in done.stdout, f"`{command}`: {word.split('=')[0]} is not a flag of it"
        checked += 1
    return checked


def console_commands(body: str) -> list[str]:
    """The commands of a ``console`` block: continuation lines joined, ``#`` lines (``#SBATCH``) left out."""
    body = body.replace("\\\n", " ")
    return commands("\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#")))


def workflow_fragment_in_full(fragment: Block) -> bool:
    """The README's CI job is the GitHub workflow of docs/ci.md, step for step."""
    job = yaml.safe_load(fragment.body)
    for block in blocks(ROOT / "docs" / "ci.md"):
        if block.lang == "yaml" and block.title:
            full = yaml.safe_load(block.body)
            if any(j == v for j in job.values() for v in (full.get("jobs") or {}).values()):
                return True
    return False


def test_every_block_is_one_the_harness_can_run():
    """Cheap: every block is classified, every Python block compiles, every workflow parses."""
    for page in PAGES:
        for block in blocks(page):
            assert block.lang in ("", "text", "bash", "console", "python", "toml", "yaml"), f"{page.name}: {block.lang}"
            if block.lang == "python":
                compile(block.body, f"{page.name}:{block.title}", "exec")
            if block.lang == "yaml":
                assert yaml.safe_load(block.body), page.name
            if block.lang in ("toml", "python") and page.name != "README.md":
                assert block.title, f'{page.name}: a {block.lang} block needs title="PATH" so a test can run it'
            if block.lang == "bash":
                for command in commands(block.body):
                    assert command.split()[0] in ("pytest", "circuits", "pip", "cat"), command


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW_PAGES else []) for p in PAGES if blocks(p)],
)
def test_the_blocks_of_the_page_run(page, tmp_path):
    assert run_page(page, tmp_path) == len(blocks(page))
