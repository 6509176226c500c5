"""Where one run's scan records come from, chosen by kind (as pytest-benchmark chooses its storage):
measured from the build (`MeasuredRecords`) or merged from shard parts (`ShardPartRecords`,
``--circuits-shard-parts``: the build is not loaded). Both are a `run.record_source.RecordSource`,
which is all the gate reads. Also the writer of one shard's part (`write_part`)."""

from __future__ import annotations

import time
from pathlib import Path

from ..options import flag
from ..record.schema import Record
from .measure import BuildMeasurement, measure_audit, said_took


def measure_record(
    m: BuildMeasurement, build_name: str, knockout: bool = True, method=None, knockout_frame=None, key_heads=None
) -> Record:
    """The scan record of one build (validated once, here), computed (and memoised) through ``m``; kappa measured by
    ``method`` (a `KappaMethod`, default the settings'); ``knockout_frame``: these knockouts (one
    shard's) instead of the run's scan; ``key_heads``: only these heads knocked out (a gate's key
    heads, said in the record: `KnockoutInfo.heads`)."""
    from ..rungs.text_probe import text_identity
    from .assemble import assemble_record, model_info, rung1_info

    s = m.loaded.settings
    method = s.kappa_method if method is None else method
    build = m.loaded.build(build_name)
    knockout = knockout and not build.identity.engine  # llama.cpp has no head to knock out (llama_engine.NOT_MEASURED)
    scanned = knockout and knockout_frame is None
    planned = m.scan_plan(build_name, scanned, method, key_heads=key_heads if scanned and key_heads else ())
    started = time.perf_counter()
    spectrum = m.ov_spectrum(build_name, method)
    probe = m.repeat_probe(build_name)
    ko_frame, ko_info = None, None
    if knockout:
        if knockout_frame is not None:
            ko_frame = knockout_frame
        else:
            ko_frame = m.head_knockout(build_name, heads=key_heads or None, change_screen=bool(key_heads))
        screened = None if key_heads else m.screen_top_k()
        ko_info = {
            **s.knockout_probe.as_dict(),
            **text_identity(build.source, build.tokens, s.knockout_probe),
            "mode": ko_frame.attrs.get("mode", s.knockout_mode),
            "screened": screened,
            "screen_method": m.screen_method(build_name) if screened is not None else None,
            **({"heads": "key heads"} if key_heads else {}),
        }
    if planned is not None:  # and after it, its wall time beside the estimate for the heads knocked out
        said_took(
            m, build_name, planned, time.perf_counter() - started, "the scan", ko_frame, key_heads=key_heads or ()
        )
    audit = None if s.audit is None else measure_audit(m, build_name).section()  # rung 3: only when a slice is given
    record = assemble_record(
        model=model_info(m.loaded.model_name, m.loaded.source, build),
        build=build.identity.as_dict(),
        probe={
            **s.probe.as_dict(),
            **text_identity(build.source, build.tokens, s.probe),
            "bos_id": build.tokens.bos_id,
            "vocab_size": build.tokens.vocab_size,
            "n_special": len(build.tokens.special_ids),
        },
        knockout_info=ko_info,
        spectrum=spectrum,
        probe_result=probe,
        knockout=ko_frame,
        rung1=rung1_info(spectrum, s, folded=True, method=method),
        audit=audit,
    )
    return Record.of(record)


class MeasuredRecords:
    """The records of builds measured in this run (memoised in its `BuildMeasurement`)."""

    def __init__(self, measurement: BuildMeasurement):
        self.measurement = measurement

    def record(self, build_name: str, knockout: bool = True, method=None, key_heads: bool = False) -> Record:
        m = self.measurement
        s = m.loaded.settings
        method = s.kappa_method if method is None else method
        full = m.loaded.memoised(("record", build_name, True, method))
        if (not knockout or key_heads) and full is not None:  # the full record serves too
            return full
        full_scan = s.records_baseline(build_name) or s.knockout_full  # a recording's key heads are not known yet
        keys = tuple(m.key_heads()) if knockout and key_heads and not full_scan else ()
        if keys:
            return m.loaded.memo(
                ("record", build_name, "key heads", method),
                lambda: measure_record(m, build_name, True, method, key_heads=keys),
            )
        return m.loaded.memo(
            ("record", build_name, knockout, method), lambda: measure_record(m, build_name, knockout, method)
        )

    def stand_in(self) -> dict:
        from ..record.store import geometry_record

        m = self.measurement
        return geometry_record(m.loaded.preflight().__dict__, probe=m.loaded.settings.probe.as_dict())

    def identity(self, build_name: str) -> dict:
        return self.measurement.loaded.build(build_name).identity.as_dict()

    def look(self, build_name: str, k: int, probe_seed: int, knockout_seed: int, heads, mode) -> dict | None:
        from dataclasses import replace

        from ..record.looks import KNOCKOUT_KEY
        from ..record.store import round_sig

        m, s = self.measurement, self.measurement.loaded.settings
        mode = mode or s.knockout_mode
        title = f"look {k} (n={s.probe.n}) {m.loaded.model_name}:{build_name}"

        def probe() -> dict:
            from ..rungs.probe import run_repeat_probe

            with m.loaded.phase(title):
                build = m.loaded.build(build_name)
                return run_repeat_probe(
                    build, replace(s.probe, seed=probe_seed), batch_size=s.batch_size
                ).sequence_figures()

        entry: dict = {"look": k, "probe_seed": probe_seed, "knockout_seed": knockout_seed}
        entry.update(m.loaded.memo(("look probe", build_name, k, probe_seed), probe))
        if heads:  # each head knocked out once a run, however many verdicts ask for it
            measured: dict = m.loaded.memo(("look knockouts", build_name, k, knockout_seed, mode), dict)
            missing = [head for head in heads if head not in measured]
            if missing:
                from ..rungs.knockout import knockout_scan

                with m.loaded.phase(f"{title}: {len(missing)} knockout(s)"):
                    frame = knockout_scan(
                        m.loaded.build(build_name),
                        replace(s.knockout_probe, seed=knockout_seed),
                        mode=mode,
                        heads=missing,
                        batch_size=s.batch_size,
                        progress=False,
                    )
                measured.update(
                    (str(r["head"]), [float(v) for v in r[KNOCKOUT_KEY]])
                    for _, r in frame.iterrows()
                    if isinstance(r.get(KNOCKOUT_KEY), list)
                )
            entry[KNOCKOUT_KEY] = {head: measured[head] for head in heads if head in measured}
        rounded: dict = round_sig(entry)  # as a stored look is (`run.assemble.assemble_record`)
        return rounded


class ShardPartRecords(MeasuredRecords):
    """``--circuits-shard-parts``: each build's record merged from its shard parts
    (`record.shards.merged_by_build`), read once; no build is loaded. Parts of a build not gated, a
    build without parts, or parts measured otherwise than asked are one line each."""

    def record(self, build_name: str, knockout: bool = True, method=None, key_heads: bool = False) -> Record:
        from ..errors import ShardError
        from ..record.kappa_method import of_record

        m = self.measurement
        merged = m.loaded.memo(("shard_parts",), self._read)
        if build_name not in merged:
            raise ShardError(
                f"{flag('shard-parts')} {m.loaded.settings.shard_parts} holds no part of build {build_name}: "
                "gate only the builds whose parts are there, or add them"
            )
        record = merged[build_name]
        method = m.loaded.settings.kappa_method if method is None else method
        if of_record(record) != method:
            raise ShardError(
                f"the parts of {build_name} measured kappa with {of_record(record).describe()}, the baseline asks for "
                f"{method.describe()}: record the baseline again, or measure the build unsharded"
            )
        return record

    def identity(self, build_name: str) -> dict:
        return self.record(build_name).build.model_dump(exclude_none=True)

    def look(self, build_name: str, k: int, probe_seed: int, knockout_seed: int, heads, mode) -> dict | None:
        return None  # a merge loads no build: an undecided row keeps the fixed rule

    def _read(self) -> dict[str, Record]:
        from ..errors import ShardError
        from ..record.shards import merged_by_build, part_paths

        s, said = self.measurement.loaded.settings, flag("shard-parts")
        pattern = str(s.shard_parts)
        merged = merged_by_build(part_paths(pattern, said))
        strays = sorted(set(merged) - set(s.builds))
        if strays:
            raise ShardError(
                f"{said} {pattern} holds parts of {', '.join(strays)}, not a build gated "
                f"({', '.join(s.builds)}): name only the parts of the builds gated"
            )
        name = self.measurement.loaded.model_name
        typed = {build_name: Record.of(record) for build_name, record in merged.items()}
        for record in typed.values():
            if record.model.name != name:
                raise ShardError(
                    f"{said} {pattern}: the parts are of model {record.model.name}, this run gates "
                    f"{name}: name the parts of this model"
                )
            text = record.probe.text  # parts of the own-text probe: its file is compared too, either way round
            asked, theirs = s.probe.as_dict(), {k: getattr(record.probe, k) for k in ("seed", "n", "L")}
            theirs |= {} if text is None else {"text": {"file": text.file, "sha256": text.sha256}}
            if theirs != asked:
                raise ShardError(
                    f"{said} {pattern}: the parts were measured with probe {theirs}, this run asks for {asked}; "
                    "give this run the shard jobs' probe options"
                )
        return typed


def record_source(measurement: BuildMeasurement) -> MeasuredRecords:
    """The run's records by kind: merged from shard parts when the settings name them, else measured."""
    kind = MeasuredRecords if measurement.loaded.settings.shard_parts is None else ShardPartRecords
    return kind(measurement)


def part_of(m: BuildMeasurement, build_name: str, index: int, total: int) -> dict:
    """Shard ``index`` of ``total`` (1-based) of the scan of ``build_name``: the part a job writes."""
    from ..errors import ShardError
    from ..record.schema import PART_FORMAT

    n_layers = m.loaded.preflight().n_layers
    if total > n_layers:
        raise ShardError(
            f"{flag('shard')} {index}/{total}: the model has {n_layers} layers, so at most {n_layers} shards; "
            f"use K <= {n_layers}"
        )
    if m.shards != total:
        raise ShardError(f"the session splits the knockouts into {m.shards} shards, not {total}")
    layers = m.shard_layers()
    frame = m.knockout_shard(build_name, index - 1)
    record = measure_record(m, build_name, knockout=True, knockout_frame=frame)
    meta = {"format": PART_FORMAT, "index": index, "of": total, "layers": layers[index - 1]}
    return {"part": meta, "record": record.data}


def write_part(m: BuildMeasurement, build_name: str, index: int, total: int, path: Path) -> dict:
    """Measure shard ``index`` of ``total`` of ``build_name`` (`part_of`) and write its part to ``path``
    atomically: the one writer of parts (``circuits record --shard``, pytest ``--circuits-shard``)."""
    from ..fsio import atomic_write_text, check_output
    from ..record.shards import dumps_part

    check_output(path)  # a link or a folder ends the job before the scan, not after
    part = part_of(m, build_name, index, total)
    atomic_write_text(path, dumps_part(part))
    return part
