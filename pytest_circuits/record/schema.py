"""The validated schema of a scan record (baselines and ``circuits scan --json``).

Built with pydantic v2 from the figure table (`record/figures.py`), so a figure is declared
once and checked everywhere: strict types (a string is never a number, a bool never a
float), ranges, head labels that exist in the stated geometry, every head of the geometry
present exactly once, eigenvalue arrays of ``d_head`` pairs. pydantic rather than
jsonschema: the models are built from Python declarations we already have, cross-field
checks (labels against geometry) are plain Python, and every error carries its location.
Unknown extra keys are allowed (a newer minor version may add figures).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from ..errors import CircuitsError
from ..options import KNOCKOUT_MODES
from . import figures, kappa_method
from .audit import AuditInfo
from .seeds import look_seed

SCHEMA_VERSION = 1
PART_FORMAT = 1  # of a shard part's header (`PartInfo`, `record.shards`)

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
_TYPES: dict[str, Any] = {"float": float, "int": int, "bool": bool, "str": str}


_INTERVAL = Annotated[list[float], Field(min_length=2, max_length=2)]  # [low, high]


def _field(figure: figures.Figure) -> tuple[Any, Any]:
    """``(annotation, default)`` of one stored head or model figure."""
    kind: Any = _INTERVAL if figure.kind == "interval" else _TYPES[figure.kind.removesuffix("s")]
    if figure.kind != "interval" and (figure.low is not None or figure.high is not None):
        kind = Annotated[kind, Field(ge=figure.low, le=figure.high)]
    if figure.kind == "floats":  # one value per probe sequence, each in the figure's range
        kind = Annotated[list[kind], Field(min_length=1)]
    if figure.nullable or figure.stored == "measured":
        kind = kind | None
    return kind, (None if figure.stored == "measured" else ...)


class Geometry(BaseModel):
    model_config = _STRICT
    n_layers: int = Field(ge=1)
    n_heads: int = Field(ge=1)
    n_kv_heads: int = Field(ge=1)
    d_model: int = Field(ge=1)
    d_head: int = Field(ge=1)
    vocab: int = Field(ge=2)
    attention_layers: list[int] | None = None  # a hybrid stack: the block of each attention layer L0, L1, ...

    @model_validator(mode="after")
    def _attention_blocks(self) -> Geometry:
        """On a hybrid stack, one increasing block index per attention layer (the heads' layers)."""
        blocks = self.attention_layers
        if blocks is not None and (
            len(blocks) != self.n_layers or blocks[0] < 0 or any(a >= b for a, b in zip(blocks, blocks[1:]))
        ):
            raise ValueError(
                f"geometry.attention_layers {blocks} is not one increasing block index per attention layer "
                f"(n_layers {self.n_layers})"
            )
        return self


class ModelInfo(BaseModel):
    model_config = _STRICT
    name: str
    spec: str
    family: str  # the layout read (older records: the only name)
    model_type: str | None = None  # config.model_type (records from before it was kept have none)
    quirks: list[str] | None = None  # the quirk tags this config enables (`families.active_quirks`)
    fingerprint: str | None = None
    geometry: Geometry


class BuildInfo(BaseModel):
    model_config = _STRICT
    recipe: str = Field(min_length=1)
    dtype: str
    backend: str
    backend_version: str
    device: str
    # external builds (NAME=PATH) only; older baselines have none of them (model/recipes.EXTERNAL_KEYS)
    source: str | None = None  # the path typed
    format: str | None = None  # "gguf", "safetensors", "bnb-8bit-serialized", ...
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    tensor_types: dict[str, Annotated[int, Field(ge=1)]] | None = None  # stored type -> tensor count
    quantization: str | None = None  # a quantized format's scheme and modules (compressed-tensors)
    forward: str | None = None  # its forward path: the format's own kernel, or its reference
    kv_cache: str | None = None  # the KV-cache precision it is served with (model/kv_formats.py); none: full
    engine: str | None = None  # what ran the probe when not torch (model/llama_engine.py); none: torch


class ProbeTextInfo(BaseModel):
    """The own-text probe's identity (`rungs.text_probe`): the file's name and sha256, how the model read it
    (``tokenizer`` or the embedded model's ``words``) and the sha256 of the probe's ids."""

    model_config = _STRICT
    file: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tokens: str | None = None  # absent from a stand-in (the settings, before the model reads the text)
    ids_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class ProbeInfo(BaseModel):
    model_config = _STRICT
    seed: int = Field(ge=0)
    n: int = Field(ge=1)
    L: int = Field(ge=2)
    text: ProbeTextInfo | None = None  # the own-text probe's file; None: the random-repeat probe


class KnockoutInfo(ProbeInfo):
    mode: str
    # the screen's K (`records`); None: every head knocked out exactly. Unchecked, as when it was an extra
    # key: older records and hand-built ones hold a bool
    screened: Any = None
    # "key heads": only the key heads of the baselines a gate compared with were knocked out (a gate's
    # record, `run.records`); None: every head, or the screen's top K and the key heads (``screened``)
    heads: Literal["key heads"] | None = None

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str) -> str:
        if mode not in KNOCKOUT_MODES:
            raise ValueError(f"knockout mode {mode!r} is not one of {', '.join(KNOCKOUT_MODES)}")
        return mode


class Rung1Info(BaseModel):
    """How kappa was measured (`record.kappa_method`); a key left out means the older records' way."""

    model_config = _STRICT
    n_rotations: int = Field(ge=2)
    q: float = Field(gt=0.0, lt=1.0)
    folded: bool = True
    unembedding: Literal[kappa_method.UNEMBEDDINGS] | None = None  # type: ignore[valid-type]
    p_method: Literal[kappa_method.P_METHODS] | None = None  # type: ignore[valid-type]
    null_dtype: Literal[kappa_method.NULL_DTYPES] | None = None  # type: ignore[valid-type]
    min_effect: float | None = Field(default=None, ge=0.0, lt=2.0)  # None: an older record, flagged on q alone


_SEQUENCES = {f.name: _field(f) for f in figures.SEQUENCE_FIGURES if f.kind == "floats"}  # <figure>_sequences
_KNOCKOUT_SEQUENCES = figures.sequences_key("knockout_delta")
_HeadSequences = dict[str, Annotated[list[float], Field(min_length=1)]]  # head label -> one value per sequence

_MODEL_FIGURES = {f.name: (Annotated[float, Field(ge=f.low, le=f.high)], ...) for f in figures.MODEL_FIGURES}
_MODEL_FIGURES.update({f.name: _field(f) for f in figures.SEQUENCE_FIGURES})  # absent in older records
# optional per-position series (older baselines lack them): floats in range, 2L-1 of them
_SERIES = {f.name: (list[Annotated[float, Field(ge=f.low, le=f.high)]] | None, None) for f in figures.SERIES_FIGURES}

if TYPE_CHECKING:  # what mypy reads of the models built from the figure table (tests/test_import_layers.py
    # checks these declarations name the same fields, of the same types, as the built models)

    class HeadRow(BaseModel):
        head: str
        layer: int
        head_index: int
        kappa: float
        kappa_trace: float
        kappa_null_mean: float
        kappa_null_sd: float
        kappa_z: float
        kappa_p: float
        kappa_q: float
        copying: bool
        suppression: bool
        kappa_trace_z: float | None
        copying_trace: bool | None
        suppression_trace: bool | None
        ov_gain: float | None
        kappa_uncentred: float | None
        kappa_trace_uncentred: float | None
        prefix_matching: float | None
        previous_token: float | None
        duplicate_token: float | None
        path_factor: float | None
        knockout_delta: float | None
        knockout_estimate: float | None
        knockout_atp: float | None
        knockout_delta_sequences: list[float] | None
        knockout_delta_interval: list[float] | None

    class _Figures(BaseModel):
        copy_loss: float
        first_copy_loss: float
        copy_gain: float
        uniform_loss: float
        copy_loss_sequences: list[float] | None
        copy_loss_interval: list[float] | None
        first_copy_loss_sequences: list[float] | None
        first_copy_loss_interval: list[float] | None
        copy_gain_sequences: list[float] | None
        copy_gain_interval: list[float] | None
        position_loss: list[float] | None

    class _LookValues(BaseModel):
        copy_loss_sequences: list[float] | None
        first_copy_loss_sequences: list[float] | None
        copy_gain_sequences: list[float] | None
        knockout_delta_sequences: dict[str, list[float]] | None

else:
    HeadRow = create_model(
        "HeadRow", __config__=_STRICT, **{f.name: _field(f) for f in figures.HEAD_FIGURES if f.stored}
    )
    _Figures = create_model("_Figures", __config__=_STRICT, **_MODEL_FIGURES, **_SERIES)
    _LookValues = create_model(
        "_LookValues",
        __config__=ConfigDict(strict=True, extra="forbid", allow_inf_nan=False),
        **_SEQUENCES,
        **{_KNOCKOUT_SEQUENCES: (_HeadSequences | None, None)},
    )


class Look(_LookValues):
    """One further look of the sequential rule (`record.looks`): its number ``k`` >= 2, its seeds
    (`record.looks.look_seed` of the record's probe and knockout seeds, checked by the `Record`), and
    one value per sequence of each figure it measured: ``<figure>_sequences`` (``n`` finite values in
    the figure's range) and ``knockout_delta_sequences`` (``{head: n values}``). Nothing else: a key
    the gate would not read is refused, not ignored."""

    look: int = Field(ge=2)
    probe_seed: int = Field(ge=0)
    knockout_seed: int = Field(ge=0)

    def values(self, key: str) -> Any:
        """The look's ``<figure>_sequences``: a list, or ``{head: list}`` of knockout deltas; None without."""
        return getattr(self, key, None)

    def measured(self) -> tuple[str, ...]:
        """The ``<figure>_sequences`` keys this look holds values for."""
        return tuple(key for key in (*_SEQUENCES, _KNOCKOUT_SEQUENCES) if getattr(self, key) is not None)


class Record(_Figures):
    """One scan record; `model_validator` checks the heads against the geometry.

    What the gate reads (`Record.of`, once where a record enters: a baseline read, a build
    measured, parts merged); the dict it was read from is what is written (`data`).
    """

    schema_version: Literal[1]
    model: ModelInfo
    build: BuildInfo
    probe: ProbeInfo
    knockout: KnockoutInfo | None = None
    rung1: Rung1Info | None = None
    heads: list[HeadRow]
    eigenvalues: dict[str, list[Annotated[list[float], Field(min_length=2, max_length=2)]]] = Field(
        default_factory=dict
    )  # head -> [[re, im], ...]
    looks: list[Look] | None = None  # the further looks of the sequential rule (`record.looks`)
    audit: AuditInfo | None = None  # rung 3 on an audit slice (`record.audit`); only when one was given
    _data: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def of(cls, record: RecordLike) -> Record:
        """``record`` itself when it is a `Record`, else the validated `Record` of a record dict; one
        line (`CircuitsError`) naming the first problem when it is not one."""
        if isinstance(record, Record):
            return record
        try:
            typed = cls.model_validate(record)
        except ValidationError as error:
            raise CircuitsError(
                f"the scan record given is not valid: {problem(error)}; pass a record pytest-circuits measured "
                "or read (record.store.read_baseline)"
            ) from None
        typed._data = record if isinstance(record, dict) else dict(record)
        return typed

    @property
    def data(self) -> dict[str, Any]:
        """The record dict this was validated from (what a baseline file holds)."""
        return self._data or self.model_dump(exclude_unset=True)

    def with_looks(self, entries: list[dict[str, Any]]) -> Record:
        """This record with ``entries`` (look dicts, as measured) after the looks it holds, validated."""
        return Record.of({**self.data, "looks": [*(self.data.get("looks") or []), *entries]})

    @model_validator(mode="after")
    def _heads_match_geometry(self) -> Record:
        geo = self.model.geometry
        seen: set[str] = set()
        for i, row in enumerate(self.heads):
            cell = figures.parse_label(row.head)
            if cell is None:
                raise ValueError(f"heads[{i}].head {row.head!r} is not a head label L<layer>H<head>")
            layer, head = cell
            if not (layer < geo.n_layers and head < geo.n_heads):
                raise ValueError(
                    f"heads[{i}].head {row.head} does not exist in a model of "
                    f"{geo.n_layers} layers x {geo.n_heads} heads"
                )
            if (row.layer, row.head_index) != (layer, head):
                raise ValueError(
                    f"heads[{i}] is labelled {row.head} but has layer {row.layer}, head_index {row.head_index}"
                )
            if row.head in seen:
                raise ValueError(f"heads[{i}].head {row.head} appears twice")
            seen.add(row.head)
        expected = geo.n_layers * geo.n_heads
        if len(seen) != expected:
            raise ValueError(
                f"heads holds {len(seen)} of the geometry's {expected} heads "
                f"({geo.n_layers} layers x {geo.n_heads} heads)"
            )
        self._sequences_match()
        self._looks_match(seen)
        for name in _SERIES:
            series = getattr(self, name)
            if series is not None and len(series) != 2 * self.probe.L - 1:
                raise ValueError(f"{name} holds {len(series)} values, the probe's 2L-1 is {2 * self.probe.L - 1}")
        for label, pairs in self.eigenvalues.items():
            if label not in seen:
                raise ValueError(f"eigenvalues.{label} names a head that is not in heads")
            if len(pairs) != geo.d_head:
                raise ValueError(f"eigenvalues.{label} holds {len(pairs)} values, d_head is {geo.d_head}")
        return self

    def _looks_match(self, heads: set[str]) -> None:
        """The further looks pair with look 1 and with each other: numbered 2..K once each, in order;
        seeded as `record.looks.look_seed` derives from the record's seeds; each holding the figures
        the others hold, one value per sequence (the probe's ``n``, the knockout's ``n``), for
        figures the record has per-sequence values of, and knockout deltas of the heads of the look
        before or fewer (a build's look knocks out only the heads still undecided: `run.looks`)."""
        if not self.looks:
            return
        numbers = [entry.look for entry in self.looks]
        if numbers != list(range(2, len(numbers) + 2)):
            raise ValueError(f"looks are numbered {numbers}, not 2..{len(numbers) + 1} once each in order")
        first, before = self.looks[0].measured(), set(self.looks[0].knockout_delta_sequences or {})
        for entry in self.looks:
            where = f"looks[{entry.look - 2}] (look {entry.look})"
            seeds = {"probe_seed": (entry.probe_seed, self.probe.seed)}
            if self.knockout is not None:
                seeds["knockout_seed"] = (entry.knockout_seed, self.knockout.seed)
            for key, (seed, root) in seeds.items():
                if seed != look_seed(root, entry.look):
                    raise ValueError(
                        f"{where}.{key} is {seed}, not {look_seed(root, entry.look)}, the seed of look "
                        f"{entry.look} of the record's seed {root}: its sequences would pair with none of the build's"
                    )
            if entry.measured() != first:
                raise ValueError(
                    f"{where} holds {', '.join(entry.measured()) or 'no values'}, look 2 {', '.join(first)}"
                )
            for name in figures.SAMPLED_MODEL_FIGURES:
                values = entry.values(figures.sequences_key(name))
                if values is None:
                    continue
                if getattr(self, figures.sequences_key(name)) is None:
                    raise ValueError(f"{where} holds {figures.sequences_key(name)} but look 1 holds none")
                if len(values) != self.probe.n:
                    raise ValueError(
                        f"{where}.{figures.sequences_key(name)} holds {len(values)} values but the probe has n={self.probe.n}"
                    )
            deltas = entry.knockout_delta_sequences
            if deltas is None:
                continue
            if self.knockout is None:
                raise ValueError(f"{where} holds {_KNOCKOUT_SEQUENCES} but the record has no knockouts")
            if not set(deltas) <= before:
                raise ValueError(
                    f"{where}.{_KNOCKOUT_SEQUENCES} names heads {sorted(set(deltas) - before)} that the look "
                    f"before does not ({sorted(before)})"
                )
            before = set(deltas)
            for head, values in deltas.items():
                if head not in heads:
                    raise ValueError(f"{where}.{_KNOCKOUT_SEQUENCES}.{head} names a head that is not in heads")
                if len(values) != self.knockout.n:
                    raise ValueError(
                        f"{where}.{_KNOCKOUT_SEQUENCES}.{head} holds {len(values)} values but the knockout has n={self.knockout.n}"
                    )

    def _sequences_match(self) -> None:
        """Per-sequence figures: one per probe (or knockout) sequence, averaging to their figure;
        intervals ordered ``low <= high``."""
        for name in figures.SAMPLED_MODEL_FIGURES:
            _check_sampled(
                name,
                getattr(self, name),
                getattr(self, figures.sequences_key(name)),
                getattr(self, figures.interval_key(name)),
                self.probe.n,
                "probe",
            )
        for i, row in enumerate(self.heads):
            for name in figures.SAMPLED_HEAD_FIGURES:
                n = self.knockout.n if self.knockout is not None else None
                _check_sampled(
                    f"heads[{i}].{name}",
                    getattr(row, name),
                    getattr(row, figures.sequences_key(name)),
                    getattr(row, figures.interval_key(name)),
                    n,
                    "knockout",
                )


def typed_record(record: Any) -> Record | str:
    """The validated `Record` of ``record`` (a record dict of this schema version, kept as its `data`),
    or what makes it not one, in a few words."""
    if isinstance(record, Record):
        return record
    if not isinstance(record, dict):
        return "is not a scan record (top level is not an object)"
    version = record.get("schema_version")
    if version != SCHEMA_VERSION:
        return f"has schema version {version!r}, this pytest-circuits reads {SCHEMA_VERSION}"
    try:
        typed = Record.model_validate(record)
    except ValidationError as error:
        return f"is not a valid scan record: {problem(error)}"
    typed._data = record
    return typed


def head_dicts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The head rows of a record dict as stored (what is written), in the order of its `Record`'s
    ``heads``: to edit in place (a shard merge's knockout figures), never to read figures from."""
    rows: list[dict[str, Any]] = record.get("heads") or []
    return rows


Head = HeadRow  # one head row of a record
RecordLike = Record | Mapping[str, Any]  # a typed record, or a record dict `Record.of` validates


class HeadWrite(BaseModel):
    """What a result frame's row says a head writes (`assertions`): its label, and its OV gain and
    ``path_factor`` when the frame has them (None: not measured); the part of a `HeadRow` the
    negligible-head cut reads (`gate.invariants.head_writes`)."""

    model_config = ConfigDict(extra="forbid")
    head: str
    ov_gain: float | None = None
    path_factor: float | None = None


class HeadWrites(BaseModel):
    """A partial record: only the heads' writes, as a result frame carries them. Never a scan record
    (no figure, model or build): the assertions' way into the negligible-head cut, validated as such."""

    model_config = ConfigDict(extra="forbid")
    heads: list[HeadWrite]

    @classmethod
    def of(cls, rows: list[dict[str, Any]]) -> HeadWrites:
        """The validated writes of ``rows`` (a frame's records); one line (`CircuitsError`) naming the
        first problem when they are not."""
        try:
            return cls.model_validate({"heads": rows})
        except ValidationError as error:
            raise CircuitsError(
                f"the result frame's head writes are not valid: {problem(error)}; pass a frame from ov_spectrum"
            ) from None


_LOOSE = ConfigDict(extra="allow")


class _SomeGeometry(BaseModel):
    model_config = _LOOSE
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    d_model: int | None = None
    d_head: int | None = None
    vocab: int | None = None
    attention_layers: list[int] | None = None


class _SomeModel(BaseModel):
    model_config = _LOOSE
    name: str | None = None
    family: str | None = None
    model_type: str | None = None
    fingerprint: str | None = None
    geometry: _SomeGeometry | None = None


class _SomeProbe(BaseModel):
    model_config = _LOOSE
    seed: int | None = None
    n: int | None = None
    L: int | None = None
    text: ProbeTextInfo | None = None


class _SomeBuild(BaseModel):
    model_config = _LOOSE
    kv_cache: str | None = None
    engine: str | None = None


class Identity(BaseModel):
    """What a record says of its model, probe and build, and nothing else: read from a `Record`
    as it is, or from a partial record dict (a stand-in of a build not measured yet,
    `store.geometry_record`; a record measured now), each part optional. What `record.store`'s
    comparisons (geometry, probe, engine, KV cache, weights) read."""

    model_config = _LOOSE
    model: _SomeModel | None = None
    probe: _SomeProbe | None = None
    build: _SomeBuild | None = None

    @classmethod
    def of(cls, record: RecordLike | Identity) -> Record | Identity:
        """``record`` itself when it is typed, else the identity parts of a record dict (no figure read)."""
        if isinstance(record, (Record, Identity)):
            return record
        return cls.model_validate({key: record.get(key) for key in ("model", "probe", "build")})


class PartInfo(BaseModel):
    """The header of a shard part (`record.shards`): shard ``index`` of ``of``, measuring ``layers``."""

    model_config = _STRICT
    format: int  # PART_FORMAT (strict: never True)
    index: int = Field(ge=1)
    of: int = Field(ge=1)
    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)

    @model_validator(mode="after")
    def _index_in_split(self) -> PartInfo:
        if self.format != PART_FORMAT:
            raise ValueError(f"format {self.format} is not {PART_FORMAT}, the part format this pytest-circuits reads")
        if self.index > self.of:
            raise ValueError(f"index {self.index} is above of {self.of} (shard I/K has 1 <= I <= K)")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers {self.layers} names a layer twice")
        return self


SAMPLED_MATCH = 1e-5  # per-sequence values, rounded like every figure, average to it within this x (1 + max |value|)


def _check_sampled(
    name: str,
    value: float | None,
    sequences: list[float] | None,
    interval: list[float] | None,
    n: int | None,
    probe: str,
) -> None:
    if interval is not None and not interval[0] <= interval[1]:
        raise ValueError(f"{figures.interval_key(name)} {interval} has low above high")
    if sequences is None:
        return
    if n is not None and len(sequences) != n:
        raise ValueError(f"{figures.sequences_key(name)} holds {len(sequences)} values but the {probe} has n={n}")
    if value is not None:
        mean = sum(sequences) / len(sequences)
        if abs(mean - value) > SAMPLED_MATCH * (1 + max(abs(v) for v in sequences)):
            raise ValueError(f"{figures.sequences_key(name)} average {mean:.6g}, not {name} {value:.6g}")


def problem(error: ValidationError) -> str:
    """The first violation of a record as ``field: what is wrong (got X)``, plus how many more."""
    errors = error.errors(include_url=False)
    first = errors[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
    message = first["msg"].removeprefix("Value error, ")
    got = "" if first["type"] in ("missing", "value_error") else f" (got {_short(first.get('input'))})"
    more = f"; {len(errors) - 1} more problem(s)" if len(errors) > 1 else ""
    return f"{where + ': ' if where else ''}{message}{got}{more}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
