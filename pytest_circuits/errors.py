"""User-facing errors: each carries one line that names the thing and the fix."""

import sys


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's text (its type name if it has none)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def one_line(error: BaseException) -> str:
    """An exception's whole text on one line (``TypeName`` if it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def closest(word: object, choices) -> str | None:
    """The choice closest to a mistyped ``word`` (difflib, ratio 0.6 or more), else None."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return close[0] if close else None


def line_of(error: BaseException) -> str:
    """A `CircuitsError`'s text as printed: one line, whatever a name in it holds (a newline in a path
    typed is shown as ``\\n``)."""
    return str(error).replace("\r", "\\r").replace("\n", "\\n")


def did_you_mean(word: object, choices) -> str:
    """``" (did you mean 'X'?)"`` for the choice closest to a mistyped ``word`` (`closest`), else ""."""
    close = closest(word, choices)
    return f" (did you mean {close!r}?)" if close else ""


class CircuitsError(Exception):
    """A problem with the user's input (model, build, baseline, option).

    The plugin and the CLI print ``str(error)`` as one line, never a traceback.
    """


class ModelLoadError(CircuitsError):
    """A model could not be found or loaded safely."""


class UnknownFamilyError(CircuitsError):
    """The model's architecture is not in the family table."""


class RecipeError(CircuitsError):
    """A build recipe is unknown or cannot run on the chosen device."""


class BaselineError(CircuitsError):
    """A baseline file is missing, corrupt, or belongs to another model."""


class BaselineMissing(BaselineError):
    """No baseline file where one was expected."""


class BaselineCorrupt(BaselineError):
    """A baseline file that is unreadable, not JSON, or not a valid scan record."""


class ForeignBaseline(BaselineError):
    """A baseline of another model geometry, or recorded with other probe settings."""


class FileSystemError(CircuitsError):
    """A file or folder could not be read or written (read-only, missing, full, in the way)."""


class CircuitsWarning(UserWarning):
    """A Python warning of pytest-circuits (the run goes on): this project's own suite makes it an error."""


def warn(text: str) -> None:
    """One warning line on stderr (the run goes on)."""
    print(f"pytest-circuits: warning: {text}", file=sys.stderr)


class ShardError(CircuitsError):
    """A bad ``--shard``, or parts that are not one build's shards."""
