"""Every knob of a circuits run, read once from options, ini or the CLI (see `options.py`).

Light: no torch, numpy or pandas here, so the pytest plugin costs nothing to load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import ShardError
from .options import (
    BY_NAME,
    DEFAULT_BUILDS,
    DEFAULT_MODEL,
    DEFAULT_REFERENCE,
    DEFAULT_SCREEN_QK_TOP,
    flag,
    parse_shard,
    parse_value,
)
from .record.kappa_method import KappaMethod
from .rungs.audit_slice import AuditSlice, read_slice
from .rungs.repeat_settings import ProbeTextError, RepeatSettings, read_probe_text


@dataclass
class CircuitsSettings:
    """What to load, which builds to gate, and how to probe them."""

    model: str = DEFAULT_MODEL
    name: str | None = None  # the model's name in baseline file names (None: from the source)
    builds: tuple[str, ...] = DEFAULT_BUILDS  # build names: recipes, or the NAME of a NAME=PATH build
    reference: str = DEFAULT_REFERENCE
    external: tuple = ()  # the `recipes.BuildSpec` of every NAME=PATH build above (builds and reference)
    baselines: Path = Path("baselines")
    baselines_given: bool = True  # False: the default folder, which falls back to a named model's shipped one
    update: bool = False  # record baselines (rewriting a file only when a figure moved)
    update_all: bool = False  # record baselines, rewriting every file
    device: str = "auto"
    device_map: str = "none"  # accelerate's device_map strategy for a model over several GPUs
    engine: str = "torch"  # what runs the repeat probe: torch, or llama.cpp on GGUF builds (model/llama_engine.py)
    report: Path | None = None
    swap_baseline: Path | None = None  # a base-model swap: the replaced model's baseline file
    trust_remote_code: bool = False
    probe: RepeatSettings = field(default_factory=RepeatSettings)
    knockout_seed: int = 1  # held out: differs from the probe's seed
    knockout_mode: str = "zero"  # or "mean"
    knockout_screen: int | None = None  # exact knockouts only on the top k of an attribution screen
    knockout_full: bool = False  # every head exactly, whatever the model's size (session.screen_top_k)
    knockout_screen_method: str = "auto"  # how the screen ranks heads (rungs/screen.py; auto: session.screen_method)
    knockout_screen_sequences: int | None = None  # the screen's own knobs (rungs/screen.ScreenVariant)
    knockout_screen_qk_top: int | None = DEFAULT_SCREEN_QK_TOP
    knockout_screen_grad_drop_layers: int | None = None
    knockout_screen_ablation: str = "scan"
    # How new records measure kappa (centred W_U, 32-draw t null); the gate measures a build the
    # way its baseline was measured (record/kappa_method.py, run/flow.candidate_record).
    kappa_method: KappaMethod = field(default_factory=KappaMethod)
    knockout_shards: int | None = None  # layer shards of the knockout scan (None: automatic)
    shard: tuple[int, int] | None = None  # (i, K): this job measures only knockout shard i of K (record/shards.py)
    shard_out: Path | None = None  # where a shard job writes its part
    shard_parts: str | None = None  # gate the record merged from these parts (a glob or folder) instead of measuring
    audit: AuditSlice | None = None  # rung 3: the audit slice read and checked once (rungs/audit_slice.py)
    fdr_q: float = 0.05
    batch_size: int = 8
    tolerances: dict = field(default_factory=dict)  # gate tolerance overrides (ini circuits_tol_*)

    def __post_init__(self) -> None:
        """Every build of the run and its reference parsed once into its typed `recipes.BuildSpec`
        (a NAME=PATH from ``external``, else the recipe, checked: a bad name is one line here)."""
        from .model.recipes import parse_build_spec

        named = {spec.name: spec for spec in self.external}
        names = dict.fromkeys((*self.builds, self.reference))
        self._specs = {name: named.get(name) or parse_build_spec(name) for name in names}

    def spec(self, name: str):
        """The `recipes.BuildSpec` of build ``name``: one of the run's, parsed once; another (the build a
        baseline file names) parsed now."""
        from .model.recipes import parse_build_spec

        known = self._specs.get(name)
        return known if known is not None else parse_build_spec(name)

    def records_baseline(self, build_name: str) -> bool:
        """Whether this run writes ``build_name``'s baseline (``update``: a gated build or the reference)."""
        return self.update and build_name in (self.reference, *self.builds)

    @property
    def knockout_probe(self) -> RepeatSettings:
        """The held-out repeat sequences knockouts are measured on."""
        return RepeatSettings(seed=self.knockout_seed, n=self.probe.n, L=self.probe.L, text=self.probe.text)


def option_help(option) -> str:
    """An option's help as both front ends and docs/options.md show it: an option that takes builds goes
    on with the build syntax (`model.recipes.build_syntax_text`, made from the recipe table)."""
    if not option.syntax:
        return option.help
    from .model.recipes import build_syntax_text

    return f"{option.help}; {build_syntax_text()}"


def build_settings(raw: dict, baselines: Path, front_end: str | None = None, **fixed) -> CircuitsSettings:
    """Settings from raw option values (strings from the command line or ini, or values), each
    checked by its `options.Option`; a bad one is a one-line error naming the flag typed.

    ``baselines``: the folder when no option names one. ``fixed``: settings given directly.
    """
    from .model.recipes import parse_build_specs, reference_spec

    def get(name):
        return parse_value(name, raw.get(name), front_end)

    said = flag("shard", front_end)
    shard = None if get("shard") is None else parse_shard(get("shard"), said)
    knockout_shards = get("knockout-shards")
    if shard is not None and knockout_shards not in (None, shard[1]):
        flags = f"{said} {shard[0]}/{shard[1]} and {flag('knockout-shards', front_end)} {knockout_shards}"
        raise ShardError(f"{flags} split the scan two ways; give one")

    text = get("probe-text")  # the own-text probe: read once, here (rungs/repeat_settings.py)
    if text is not None:
        if get("engine") != "torch":
            said = f"{flag('probe-text', front_end)} with {flag('engine', front_end)} {get('engine')}"
            raise ProbeTextError(f"{said}: the own-text probe runs on torch only; drop one of them")
        text = read_probe_text(text, flag("probe-text", front_end), get("trust-remote-code"))

    specs = parse_build_specs(get("builds"))
    reference = reference_spec(get("reference"), specs)

    values = dict(
        model=get("model"),
        name=get("name"),
        builds=tuple(spec.name for spec in specs),
        reference=reference.name,
        external=tuple({s.name: s for s in (*specs, reference) if s.external}.values()),
        baselines=get("baselines") or baselines,
        baselines_given=get("baselines") is not None,
        update=get("update") or get("update-all"),
        update_all=get("update-all"),
        device=get("device"),
        device_map=get("device-map"),
        engine=get("engine"),
        report=get("report"),
        swap_baseline=get("swap-baseline"),
        trust_remote_code=get("trust-remote-code"),
        probe=RepeatSettings(seed=get("probe-seed"), n=get("probe-n"), L=get("probe-length"), text=text),
        knockout_mode=get("knockout-mode"),
        knockout_screen=get("knockout-screen"),
        knockout_full=get("knockout-full"),
        knockout_screen_method=get("knockout-screen-method"),
        knockout_screen_sequences=get("knockout-screen-sequences"),
        knockout_screen_qk_top=get("knockout-screen-qk-top"),
        knockout_screen_grad_drop_layers=get("knockout-screen-grad-drop-layers"),
        knockout_screen_ablation=get("knockout-screen-ablation"),
        knockout_shards=knockout_shards if shard is None else shard[1],
        shard=shard,
        shard_out=get("shard-out"),
        shard_parts=get("shard-parts"),
        batch_size=get("batch-size"),
        audit=None if get("audit") is None else read_slice(get("audit"), flag("audit", front_end)),
    )
    return CircuitsSettings(**{**values, **fixed})


def recording_words(s: CircuitsSettings, front_end: str) -> list[str]:
    """The flags that reproduce how ``s`` records a baseline (the model's name, the probe, the
    knockouts, remote code), spelled for ``front_end`` ("cli" or "pytest"); defaults are left out."""
    values = {
        "name": s.name,
        "knockout-screen": s.knockout_screen,
        "knockout-full": s.knockout_full,
        "knockout-screen-method": s.knockout_screen_method,
        "knockout-screen-sequences": s.knockout_screen_sequences,
        "knockout-screen-qk-top": s.knockout_screen_qk_top,
        "knockout-screen-grad-drop-layers": s.knockout_screen_grad_drop_layers,
        "knockout-screen-ablation": s.knockout_screen_ablation,
        "knockout-mode": s.knockout_mode,
        "trust-remote-code": s.trust_remote_code,
        "engine": s.engine,
        "probe-seed": s.probe.seed,
        "probe-n": s.probe.n,
        "probe-length": s.probe.L,
        "probe-text": None if s.probe.text is None else s.probe.text.path,
        "audit": None if s.audit is None else s.audit.path,
    }
    words: list[str] = []
    for name, value in values.items():
        option = BY_NAME[name]
        if value in (None, False) or value == option.default:
            continue
        spelled = option.cli_flag if front_end == "cli" else option.pytest_flag
        words += [spelled] if value is True else [spelled, str(value)]
    return words


def check_shard_job(settings: CircuitsSettings) -> None:
    """The pytest options of a shard job (``--circuits-shard I/K --circuits-shard-out FILE``, one
    build) and of a merge job (``--circuits-shard-parts``) fit together, or one line says why not."""
    s = settings
    if s.shard is None:
        if s.shard_out is not None:
            raise ShardError(f"{flag('shard-out')} writes a shard job's part: give {flag('shard')} I/K too")
        if s.shard_parts is not None and s.knockout_shards is not None:
            raise ShardError(
                f"{flag('shard-parts')} gates the merged parts and measures no knockout: drop {flag('knockout-shards')}"
            )
        return
    job = f"{flag('shard')} {s.shard[0]}/{s.shard[1]}"
    if s.shard_out is None:
        raise ShardError(f"{job} needs {flag('shard-out')} FILE: where this job writes its part")
    if s.shard_parts is not None:
        raise ShardError(
            f"{job} measures one shard and {flag('shard-parts')} gates the merged parts: two jobs; give one"
        )
    if s.update:
        raise ShardError(
            f"{job} measures one shard: record baselines where the parts merge ({flag('shard-parts')} ... {flag('update')})"
        )
    if len(s.builds) != 1:
        raise ShardError(
            f"{job} measures one build, got {', '.join(s.builds)}: give {flag('builds')} B (one job per build and shard)"
        )
