"""How a failure says to accept an intended change: the closing fix lines and the one builder of
the command that records a baseline again (``circuits record ...`` or this pytest run with the
update flag). The plugin, ``circuits gate`` and the missing-baseline message all take them from here."""

from __future__ import annotations

import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..options import flag
from ..record.schema import BuildInfo, Record, RecordLike
from ..record.store import SEPARATOR, SUFFIX, is_shipped
from ..settings import CircuitsSettings, recording_words

RECORD_AGAIN = "if the change is intended, record the baseline again: "


def record_command(settings: CircuitsSettings, build: str, folder: str | Path, name: str | None = None) -> str:
    """``circuits record`` that (re)records the baseline of ``build`` (a recipe or NAME=PATH) in
    ``folder``, with every setting it was gated with; ``name``: the model's name in the file's name."""
    s = settings if name is None else replace(settings, name=name)
    if s.engine != "torch":  # a build llama.cpp cannot run (the torch reference) is recorded on torch
        from ..model.llama_engine import runs
        from ..model.recipes import parse_build_spec

        if not runs(parse_build_spec(build), s.model):
            s = replace(s, engine="torch")
    words = ["circuits", "record", s.model, "--build", build, "--baselines", str(folder)]
    return shlex.join(words + recording_words(s, "cli"))


def file_record_command(settings: CircuitsSettings, build: str, baseline: Path) -> str:
    """`record_command` that rewrites the file ``baseline`` itself (its folder, its model name); a
    shipped baseline is never rewritten: the command records the same name into ./baselines."""
    name = baseline.name.removesuffix(SUFFIX).rsplit(SEPARATOR, 1)[0]
    folder = Path("baselines") if is_shipped(baseline.parent) else baseline.parent
    return record_command(settings, build, folder, name=name)


def update_command(config: Any) -> str:
    """The command this pytest run was started with (``config``: its `pytest.Config`), its arguments
    as given (``--pyargs``, paths relative to the folder it was started in), with the update flag
    added: pasted there, it records the baselines that changed (unchanged ones are not rewritten).
    ``python -m pytest`` or ``pytest`` as the run was started; under pytest-xdist the controller's
    command line."""
    worker = getattr(config, "workerinput", None)
    argv = list(worker["mainargv"]) if worker and "mainargv" in worker else None
    args = argv[1:] if argv else list(config.invocation_params.args)
    program = (argv or sys.argv or ["pytest"])[0]
    words = ["python", "-m", "pytest"] if program.endswith("__main__.py") else ["pytest"]
    update = flag("update")
    return shlex.join(words + [str(a) for a in args] + ([] if update in args else [update]))


def fix_lines(settings: CircuitsSettings, build_name: str, command: str) -> dict[str, str]:
    """The closing line of a pytest failure message, per comparison (``own``, ``reference``,
    ``swap``): how to accept the change if it is intended. ``command``: `update_command`."""
    own = RECORD_AGAIN + command
    return {
        "own": own,
        "reference": own  # the build is the reference: its own baseline is the one it missed
        if build_name == settings.reference
        else (
            f"if {build_name} may differ this much from {settings.reference}, loosen the tolerance "
            "(@pytest.mark.circuits_tolerance(...) or circuits_tol_* in [tool.pytest.ini_options]); "
            f"if the {settings.reference} build changed on purpose, record its baseline again: {command}"
        ),
        "swap": (
            f"if {build_name} of the new model may differ this much from the model it replaces, loosen the swap_* "
            "tolerance (@pytest.mark.circuits_tolerance(...) or circuits_tol_swap_* in [tool.pytest.ini_options])"
        ),
    }


def file_fix_line(settings: CircuitsSettings, baseline: RecordLike, path: Path, across: bool) -> str:
    """The closing line of a ``circuits gate`` failure against the baseline file ``path``."""
    typed = Record.of(baseline)
    if across:
        return (
            f"if the new model may differ this much from {typed.model.name}, loosen the swap_* "
            "tolerance (--tol NAME=VALUE)"
        )
    return RECORD_AGAIN + file_record_command(settings, build_word(typed.build), path)


def build_word(build: BuildInfo) -> str:
    """How ``--build`` names a record's build: its recipe, or NAME=PATH for an external build."""
    return f"{build.recipe}={build.source}" if build.source else build.recipe
