"""What ``circuits --help`` says after the options: the build syntax and the exit codes, each declared once.

The build syntax comes from the recipe and KV-format tables (`model.recipes.build_syntax`, the rows
pytest's ``--help`` joins into one sentence); the exit codes of both front ends are declared here and
docs/gate.md's table is generated from them (scripts/regenerate_docs.py). Light: no torch.
"""

from __future__ import annotations

EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "every invariant held (gate, sensitivity), or the command did its job",
    EXIT_BROKEN: "an invariant broke, or nothing was compared (gate, sensitivity)",
    EXIT_USAGE: "a usage or input error: one line on stderr naming the thing and the fix, never a traceback",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}
"""``circuits``: exit status -> what it means."""

PYTEST_EXIT_CODES: dict[int, str] = {
    0: "every gate test passed (or was skipped, saying why)",
    1: "a gate test failed: an invariant broke",
    2: "interrupted (Ctrl-C)",
    3: "an internal error of pytest or of a plugin",
    4: "a usage or input error: one line (ERROR: ...) naming the thing and the fix, before any test runs",
    5: "no test was collected (a -k that matched nothing)",
}
"""``pytest`` with the circuits plugin: pytest's own exit codes (`pytest.ExitCode`), what each means for a gate run."""

BUILD_COMMANDS = ("scan", "record", "gate", "sensitivity")
"""The commands that take ``--build``: their help ends with the build syntax."""


def exit_codes_text() -> str:
    """The ``exit status`` paragraph of ``circuits --help`` and of each command's."""
    return "exit status:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())


def builds_paragraph() -> str:
    """The ``builds`` paragraph: each recipe with what it is, then NAME=PATH and the KV-cache suffix."""
    import textwrap

    from .model.recipes import RECIPES, build_syntax

    width = max(len(name) for name in RECIPES)
    lines = ["builds (--build; several, comma-separated, where a command takes several):"]
    lines += [f"  {name:<{width}}  {recipe.summary}" for name, recipe in RECIPES.items()]
    lines += [
        f"  {form}\n{textwrap.fill(meaning, 100, initial_indent=' ' * 6, subsequent_indent=' ' * 6)}"
        for form, meaning in build_syntax()[1:]
    ]
    return "\n".join(lines)


def epilog(command: str | None) -> str:
    """The help text after the options of ``command`` (None: the top-level ``circuits --help``)."""
    parts = [builds_paragraph()] if command in BUILD_COMMANDS else []
    return "\n\n".join([*parts, exit_codes_text()])


def exit_codes_markdown() -> str:
    """docs/gate.md's table of exit codes: ``circuits`` beside ``pytest``."""
    codes = sorted(set(EXIT_CODES) | set(PYTEST_EXIT_CODES))
    rows = ["| exit | `circuits` | `pytest` (the gate suite, your own tests) |", "|---|---|---|"]
    rows += [f"| {code} | {EXIT_CODES.get(code, '')} | {PYTEST_EXIT_CODES.get(code, '')} |" for code in codes]
    return "\n".join(rows) + "\n"
