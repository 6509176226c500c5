"""Every option of a circuits run, declared once for pytest (flags and ini keys) and the CLI.

An `Option` knows its three spellings (``--circuits-probe-n``, ini ``circuits_probe_n``,
``--probe-n``), its type, default, bounds and help; `parse` checks a raw value and names
the flag the user actually typed. `flag(name)` spells an option for the front end that is
running (pytest or the ``circuits`` command), so hints deep in the code are copyable.

Light by design: this module imports nothing heavier than the standard library, because
pytest imports it for every run of every project that has the plugin installed.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CircuitsError, ShardError, did_you_mean

DEFAULT_MODEL = "tiny-induction"
DEFAULT_BUILDS = ("fp32", "bnb-int8", "bnb-nf4")
DEFAULT_REFERENCE = "fp32"
KNOCKOUT_MODES = ("zero", "mean")  # zero or mean ablation of a head's z (rungs/ablation.py)
SCREEN_METHODS = ("atp*", "atp*gd", "atp")  # how a knockout screen ranks heads (rungs/screen.py)
SCREEN_ABLATIONS = ("scan", "both")  # the screen's ablation: the scan's own, or the mean of zero and mean
# atp*'s QK fix on plain AtP's top 24 heads only: the exact top 5's recall in the top 12 of full atp*
# on SmolLM2, a Gemma-3-270M shape and the embedded model, at a third of its cost on SmolLM2
# (docs/speed.md, "Screen variants"); a value of at least the model's heads is the full QK fix
DEFAULT_SCREEN_QK_TOP = 24
DEVICE_MAPS = ("none", "auto", "balanced", "balanced_low_0", "sequential")  # accelerate's device_map strategies
ENGINES = ("torch", "llama.cpp")  # what runs the repeat probe (model/llama_engine.py)

FRONT_END: ContextVar[str] = ContextVar("circuits_front_end", default="pytest")


class OptionError(CircuitsError):
    """An option value out of its type or bounds."""


@dataclass(frozen=True)
class Option:
    """One knob: ``kind`` is ``str``, ``int``, ``bool``, ``path`` or ``choice``."""

    name: str  # "probe-n": pytest --circuits-probe-n, ini circuits_probe_n, CLI --probe-n
    kind: str
    default: Any
    help: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    cli: tuple[str, ...] = ()  # CLI subcommands that take it ("" entries never)
    cli_default: Any = field(default=None)  # the CLI's default where it differs from pytest's
    syntax: bool = False  # it takes builds: its help goes on with the build syntax (`settings.option_help`)

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def ini(self) -> str:
        return "circuits_" + self.dest

    @property
    def pytest_flag(self) -> str:
        return f"--circuits-{self.name}"

    @property
    def cli_flag(self) -> str:
        return f"--{self.name}"

    def parse(self, raw: Any, front_end: str | None = None) -> Any:
        """``raw`` (a string from the command line or ini, or a value) checked and converted."""
        said = _flag_of(self, front_end)
        if raw is None or raw == "":
            return None
        if self.kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise OptionError(f"{said} must be true or false, got {raw!r}")
        if self.kind == "int":
            try:
                value = int(str(raw).strip())
            except ValueError:
                raise OptionError(f"{said} must be an integer, got {raw!r}") from None
            if self.minimum is not None and value < self.minimum:
                raise OptionError(f"{said} must be at least {self.minimum}, got {value}")
            if self.maximum is not None and value > self.maximum:
                raise OptionError(f"{said} must be at most {self.maximum}, got {value}")
            return value
        if self.kind == "choice":
            choice = str(raw).strip()
            if choice not in self.choices:
                raise OptionError(
                    f"{said} must be one of {', '.join(self.choices)}, got {raw!r}{did_you_mean(choice, self.choices)}"
                )
            return choice
        if self.kind == "path":
            path = Path(str(raw)).expanduser()
            problem = _unusable(path)
            if problem:
                raise OptionError(f"{said} {_elided(str(path))} {problem}")
            return path
        return str(raw).strip()


def _unusable(path: Path) -> str:
    """Why no file can be at ``path`` whatever is done (its links go round, its name is too long),
    in words that end a sentence naming it; "" when it may be used."""
    import errno
    import os

    try:
        os.stat(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "is a symbolic link loop (or a path through one); fix the link"
        if error.errno == errno.ENAMETOOLONG:
            return "is longer than the system allows for a file name; shorten it"
    except ValueError:  # an embedded NUL
        return "holds a NUL character; no file has such a name"
    return ""


def _elided(text: str, most: int = 80) -> str:
    """``repr(text)``, its middle elided past ``most`` characters."""
    said = repr(text)
    return said if len(said) <= most else f"{said[: most // 2]}...{said[-most // 4 :]} ({len(text)} characters)"


_SCAN_LIKE = ("scan", "record", "gate")

OPTIONS: tuple[Option, ...] = (
    Option(
        "model",
        "str",
        DEFAULT_MODEL,
        "model to gate: a save_pretrained folder, a local Hugging Face cache id, a .gguf file, "
        "or a named model (tiny-induction, smollm2-135m)",
    ),
    Option(
        "builds",
        "str",
        ",".join(DEFAULT_BUILDS),
        "comma list of builds, each gated against the baselines",
        syntax=True,
    ),
    Option(
        "reference",
        "str",
        DEFAULT_REFERENCE,
        "the build every other build is gated against (a recipe, NAME=PATH, or the NAME of an external build)",
    ),
    Option(
        "name",
        "str",
        None,
        "the model's name in baseline file names (default: the model folder's or file's name)",
        cli=("scan", "record", "gate"),
    ),
    Option(
        "baselines",
        "path",
        None,
        "baselines folder (default: baselines/ beside the ini file, else in the folder pytest started in; circuits: ./baselines)",
        cli=("record",),
        cli_default=Path("baselines"),
    ),
    Option(
        "swap-baseline",
        "path",
        None,
        "a base-model swap: the baseline file of the model this one replaces (e.g. baselines/smollm2-135m--fp32.json); "
        "every build is also gated against it on the model-level swap invariants (circuits gate: --baseline FILE)",
    ),
    Option(
        "device",
        "str",
        "auto",
        "auto, cpu, cuda or cuda:N; auto: pytest-xdist worker i gets cuda:(i mod the GPU count), else the CPU",
        cli=_SCAN_LIKE,
    ),
    Option(
        "device-map",
        "choice",
        "none",
        "spread a model too big for one GPU over the visible GPUs with accelerate's device_map "
        "(auto, balanced, balanced_low_0, sequential); none: the whole model on --circuits-device",
        choices=DEVICE_MAPS,
        cli=_SCAN_LIKE,
    ),
    Option(
        "engine",
        "choice",
        "torch",
        "what runs the repeat probe: torch, or llama.cpp on GGUF builds (NAME=FILE.gguf; its own kernels and "
        "KV cache, +kv-q8_0 etc.; routing scores with its f16 cache only, knockouts skipped; "
        'pip install "pytest-circuits[llama]")',
        choices=ENGINES,
        cli=_SCAN_LIKE,
    ),
    Option("report", "path", None, "write an HTML and markdown report to this folder"),
    Option(
        "probe-seed", "int", 0, "seed of the random-repeat probe tokens", minimum=0, maximum=2**63 - 1, cli=_SCAN_LIKE
    ),
    Option("probe-n", "int", 8, "number of random-repeat sequences", minimum=1, maximum=1_000_000, cli=_SCAN_LIKE),
    Option(
        "probe-length",
        "int",
        64,
        "length L of each random segment (sequences are 2L long)",
        minimum=2,
        maximum=1_000_000,
        cli=_SCAN_LIKE,
    ),
    Option(
        "probe-text",
        "path",
        None,
        "the own-text probe: draw the repeat probe's n passages of L tokens from this text file (the team's "
        "own, UTF-8), seeded, instead of random ids; copy loss, routing scores and knockouts are then measured "
        "on in-domain tokens (docs/definitions.md); a baseline recorded on another probe is refused",
        cli=_SCAN_LIKE,
    ),
    Option(
        "knockout-mode",
        "choice",
        "zero",
        "head knockout: zero or mean ablation",
        choices=KNOCKOUT_MODES,
        cli=_SCAN_LIKE,
    ),
    Option(
        "knockout-screen",
        "int",
        None,
        "rank heads by attribution patching and knock out only the top K exactly (big models)",
        minimum=0,
        cli=_SCAN_LIKE,
    ),
    Option(
        "knockout-full",
        "bool",
        False,
        "knock out every head exactly even on a model of more than 300 heads, where the default plan "
        "screens (docs/scale.md), and in a gate, which otherwise knocks out only its baselines' key heads "
        "(docs/gate.md)",
        cli=_SCAN_LIKE,
    ),
    Option(
        "knockout-screen-method",
        "choice",
        "auto",
        "how the screen ranks heads: atp* (attribution patching with the QK fix for saturated attention), "
        "atp*gd (and GradDrop), atp (plain attribution patching, cheapest); auto: atp* unless its counted "
        "cost passes the device's screen budget (a CPU: 1e14 FLOP, about 25 min), then atp (docs/scale.md)",
        choices=("auto", *SCREEN_METHODS),
        cli=_SCAN_LIKE,
    ),
    Option(
        "knockout-screen-sequences",
        "int",
        None,
        "the screen estimates on only the first N held-out sequences (default: all; the exact knockouts use all)",
        minimum=1,
        cli=_SCAN_LIKE,
    ),
    Option(
        "knockout-screen-qk-top",
        "int",
        DEFAULT_SCREEN_QK_TOP,
        "atp*'s QK fix only on plain AtP's top C heads, the rest ranked by AtP; C of at least the "
        "model's heads: every head (docs/speed.md, Screen variants)",
        minimum=0,
        cli=_SCAN_LIKE,
    ),
    Option(
        "knockout-screen-grad-drop-layers",
        "int",
        None,
        "atp*gd drops the gradient through only N blocks spread evenly (default: every block)",
        minimum=1,
        cli=_SCAN_LIKE,
    ),
    Option(
        "knockout-screen-ablation",
        "choice",
        "scan",
        "what the screen estimates: the scan's own ablation (scan), or the mean of the zero- and "
        "mean-ablation estimates (both: two screens)",
        choices=SCREEN_ABLATIONS,
        cli=_SCAN_LIKE,
    ),
    Option(
        "knockout-shards",
        "int",
        None,
        "split the knockout scan's layers into K shards of equal replay cost, each its own test "
        "(spread over pytest-xdist workers), merged into the unsharded record; default: one, or under "
        "xdist the worker count for models of 1024 heads or more",
        minimum=1,
        maximum=4096,
    ),
    Option(
        "shard",
        "str",
        None,
        "this job measures only shard I/K of the knockout scan (1-based, as a CI matrix or a Slurm array "
        "counts) and writes its part to --circuits-shard-out; it gates rungs 1 and 1/2 and skips rung 2, "
        "which the job that merges the parts gates (--circuits-shard-parts); one build",
    ),
    Option(
        "shard-out",
        "path",
        None,
        "with --circuits-shard: the part file this job writes (the format circuits record --shard writes)",
    ),
    Option(
        "shard-parts",
        "str",
        None,
        "gate the record merged from these shard parts (a quoted glob such as 'parts/part-*.json', or their "
        "folder) instead of measuring the builds: every build gated needs all its parts; no weights are loaded",
    ),
    Option(
        "audit",
        "path",
        None,
        "rung 3: an audit slice (JSONL: chunks, question, answer, optional cited) whose answers each build is "
        "measured on with every chunk present and with each removed; gated by document_reliance, "
        "document_attribution and answer_logprob (docs/audit.md)",
        cli=_SCAN_LIKE,
    ),
    Option("batch-size", "int", 8, "sequences per forward pass", minimum=1, maximum=1_000_000, cli=_SCAN_LIKE),
    Option(
        "update",
        "bool",
        False,
        "record the baselines of the builds tested; an existing file is rewritten "
        "only when a figure moved by more than 1e-3 relative + 1e-6, or its identity or schema changed",
    ),
    Option(
        "update-all",
        "bool",
        False,
        "record baselines rewriting every file, even where no figure moved",
        cli=("record",),
    ),
    Option(
        "trust-remote-code",
        "bool",
        False,
        "allow the model folder's own Python code to run (off unless asked for)",
        cli=_SCAN_LIKE,
    ),
)
BY_NAME = {option.name: option for option in OPTIONS}


def _flag_of(option: Option, front_end: str | None = None) -> str:
    return option.cli_flag if (front_end or FRONT_END.get()) == "cli" else option.pytest_flag


def flag(name: str, front_end: str | None = None) -> str:
    """How ``front_end`` (default: the running one) spells option ``name`` (``--circuits-probe-n`` or ``--probe-n``)."""
    return _flag_of(BY_NAME[name], front_end)


def parse_value(name: str, raw: Any, front_end: str | None = None) -> Any:
    """`Option.parse` of the option called ``name``; the default when ``raw`` is empty."""
    option = BY_NAME[name]
    value = option.parse(raw, front_end)
    return option.default if value is None else value


def markdown_table(help_of=lambda option: option.help) -> str:
    """The option rows of docs/options.md: flag, ini key, default and help (``help_of(option)``) of every option."""
    rows = []
    for option in OPTIONS:
        default = "off" if option.kind == "bool" else ("none" if option.default in (None, "") else option.default)
        rows.append(f"| `{option.pytest_flag}` | `{option.ini}` | `{default}` | {help_of(option)} |")
    return "\n".join(rows)


def parse_shard(text: str, said: str = "--shard") -> tuple[int, int]:
    """``"i/K"`` (1-based, as a CI matrix or ``SLURM_ARRAY_TASK_ID`` counts) -> ``(i, K)``; ``said``: the flag typed."""
    try:
        index, total = (int(part) for part in str(text).split("/"))
    except ValueError:
        raise ShardError(f"{said} {text!r} is not i/K (e.g. 2/4: the second of four shards)") from None
    if total < 1 or not 1 <= index <= total:
        raise ShardError(f"{said} {text}: i must lie in 1..K and K be at least 1 (e.g. 2/4)")
    most = BY_NAME["knockout-shards"].maximum
    if most is not None and total > most:  # named as typed, not as the option K becomes
        raise ShardError(f"{said} {text}: K must be at most {most}")
    return index, total
