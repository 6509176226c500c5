"""What one run measures of its builds, each figure once (in the run's memo, `loaded.LoadedBuilds`):
rung 1, the repeat probe, and the knockouts under the run's rung-2 plan (`plan`).

Light at import (the plugin may create one in any run): each method imports the layer it needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

from ..options import flag
from . import plan as rung2_plan
from .loaded import LoadedBuilds


class BuildMeasurement:
    """Per build: its rung 1, probe and knockout figures (under the run's `plan`), memoised in ``loaded``;
    ``key_heads``: the heads a screened scan always knocks out exactly (the baselines');
    ``change_screen``: the rule that picks which of them a gate knocks out (`gate.change_screen`; None: all)."""

    def __init__(
        self,
        loaded: LoadedBuilds,
        key_heads: Callable[[], Sequence[str]] = tuple,
        change_screen: Callable[[], Any] = lambda: None,
    ):
        self.loaded = loaded
        self.key_heads = key_heads
        self.change_screen = change_screen

    def ov_spectrum(self, build_name: str, method=None):
        """Rung 1: kappa of every head against the rotation null (DataFrame), measured by ``method``
        (a `record.kappa_method.KappaMethod`; default: the settings')."""
        from .steps import measure_spectrum

        m = self.loaded.settings.kappa_method if method is None else method
        if m != m.null:  # flagged with a minimum effect: the scan without one, flagged again (no second null)
            from ..rungs.kappa import reflagged

            return self.loaded.memo(
                ("ov_spectrum", build_name, m), lambda: reflagged(self.ov_spectrum(build_name, m.null), m.min_effect)
            )

        def measure():
            model = self.loaded.build(build_name).model
            with self.loaded.phase(f"rung 1 (kappa, {m.n_rotations} rotations) {self.loaded.model_name}:{build_name}"):
                return measure_spectrum(model, m, self.loaded.settings.fdr_q)

        return self.loaded.memo(("ov_spectrum", build_name, m), measure)

    def repeat_probe(self, build_name: str):
        """Rung 1/2: copy losses and per-head routing scores on the seeded repeat probe."""
        from ..rungs.probe import run_repeat_probe

        s = self.loaded.settings

        def measure():
            build = self.loaded.build(build_name)
            with self.loaded.phase(
                f"repeat probe (n={s.probe.n}, L={s.probe.L}) {self.loaded.model_name}:{build_name}"
            ):
                if s.engine == "llama.cpp":
                    from ..model.llama_engine import gguf_path, threads
                    from ..rungs.llama_probe import llama_repeat_probe

                    spec = s.spec(build_name)  # preflight (`measure_steps.engine_files`) checked every build's file
                    path, kv = gguf_path(spec, s.model), spec.kv
                    return llama_repeat_probe(path, build.tokens, build.geometry, s.probe, kv, threads())
                return run_repeat_probe(build, s.probe, batch_size=s.batch_size)

        return self.loaded.memo(("repeat_probe", build_name), measure)

    def head_knockout(self, build_name: str, heads=None, change_screen: bool = False):
        """Rung 2: knockout delta of every head (or of ``heads``, each exactly) on held-out repeat
        sequences (DataFrame). Screened, the key heads (`key_heads`) are always knocked out exactly;
        with shards (`shards`), the scan of every head is the merge of its layer shards. The scan of
        every head stores each head's plain AtP estimate too where it is cheap (``knockout_atp``,
        `rungs.knockout.knockout_scan`); ``change_screen`` (a gate's key heads): of ``heads``, only
        those the run's `change_screen` confirms."""
        chosen = None if heads is None else tuple(sorted(heads))
        screen = self.change_screen() if change_screen and chosen is not None else None
        if chosen is None and self.loaded.settings.shard is not None:
            from ..errors import ShardError

            i, k = self.loaded.settings.shard
            raise ShardError(
                f"this job measures only knockout shard {i}/{k} ({flag('shard')}): the whole scan of {build_name} "
                f"is the merge of every part ({flag('shard-parts')})"
            )
        if chosen is None and self.shards > 1:
            from ..rungs.knockout_shards import merge_knockout_shards

            return self.loaded.memo(
                ("head_knockout", build_name, None),
                lambda: merge_knockout_shards([self.knockout_shard(build_name, i) for i in range(self.shards)]),
            )
        return self.loaded.memo(
            ("head_knockout", build_name, chosen, screen is not None),  # one screen a run
            lambda: self._knockout_scan(build_name, chosen, None, screen),
        )

    def scan_plan(self, build_name: str, knockout: bool, method, key_heads: Sequence[str] = ()) -> float | None:
        """Before a build's whole scan under a rung-2 plan chosen by size (and one process doing all of
        it): say its counted cost and time (`rungs.plan.scan_estimate`) and return the seconds; else None.
        ``key_heads``: rung 2 knocks out only these heads exactly (a gate's key heads), no screen."""
        from ..rungs.plan import scan_estimate

        s = self.loaded.settings
        measured = self.loaded.memoised(("ov_spectrum", build_name, method.null)) is not None
        if s.shard is not None or self.shards > 1 or measured:
            return None  # a shard's scan, or rung 1 already measured: not the whole scan's time
        chosen = self.knockout_plan()
        if not chosen.by_size:
            return None
        build = self.loaded.build(build_name)
        rung2 = rung2_cost(self, build_name, chosen, key_heads) if knockout else None
        line, seconds = scan_estimate(build, s.probe, method, rung2)
        cleared = knockout and key_heads and self.change_screen() is not None
        self.loaded.say(
            line + ("; at most: the change screen knocks out only the key heads it does not clear" if cleared else "")
        )
        return seconds

    def knockout_plan(self) -> rung2_plan.Rung2Plan:
        """The run's rung-2 plan (`run.plan.plan`): a screen's K, the key heads always knocked out exactly."""
        return rung2_plan.plan(self.loaded.settings, self.loaded.preflight, lambda: list(self.key_heads()))

    def screen_top_k(self) -> int | None:
        """The rung-2 plan's K (`rung2_plan.screen_top_k`): None scans every head exactly."""
        return rung2_plan.screen_top_k(self.loaded.settings, self.loaded.preflight)

    def screen_method(self, build_name: str) -> str:
        """How the screen ranks heads: ``--knockout-screen-method``, or by default (``auto``) atp*
        unless its counted cost passes the device's budget, then atp, said in one line."""
        if self.loaded.settings.knockout_screen_method != "auto":
            return self.loaded.settings.knockout_screen_method

        def choose():
            from ..rungs.plan import automatic_screen_method

            method, why = automatic_screen_method(
                self.loaded.build(build_name),
                self.loaded.settings.knockout_probe,
                rung2_plan.screen_variant(self.loaded.settings),
            )
            if why:
                self.loaded.say(why)
            return method

        return self.loaded.memo(("screen_method", build_name), choose)

    def _knockout_scan(self, build_name: str, heads, layers, change_screen=None):
        from ..rungs.knockout import knockout_scan

        s = self.loaded.settings
        say = self.loaded.say
        chosen = self.knockout_plan()
        planned = said_plan(self, build_name, chosen) if chosen.by_size and heads is None else None
        started = time.perf_counter()
        frame = knockout_scan(
            self.loaded.build(build_name),
            s.knockout_probe,
            mode=s.knockout_mode,
            heads=None if heads is None else list(heads),
            screen_top_k=chosen.top_k if heads is None else None,  # named heads: each exactly, no screen
            screen_method=self.screen_method(build_name),
            must_include=chosen.must_include if heads is None else (),
            batch_size=s.batch_size,
            write=self.loaded.progress_write,
            layers=layers,
            screen_variant=rung2_plan.screen_variant(self.loaded.settings),
            atp=heads is None,
            confirm=None if change_screen is None else change_screen.confirm,
        )
        if change_screen is not None and heads is not None:
            say(cleared_line(self.loaded.build(build_name).label, len(heads), frame, change_screen.fraction))
        if planned is not None:  # and after it, its wall time beside the estimate
            said_took(self, build_name, planned, time.perf_counter() - started, "rung 2", frame, chosen)
        return frame

    @cached_property
    def shards(self) -> int:
        """Layer shards of a full knockout scan (`rung2_plan.shard_count`)."""
        return rung2_plan.shard_count(self.loaded.settings, self.loaded.workers, self.loaded.preflight)

    def shard_layers(self) -> list[list[int]]:
        """The layers of each shard (`rungs.knockout_shards.layer_shards`), from the model's config alone."""
        from ..rungs.knockout_shards import layer_shards  # noqa: I001 (light at import)

        return layer_shards(self.loaded.preflight().n_layers, self.shards)

    def knockout_shard(self, build_name: str, index: int):
        """Shard ``index`` of the knockout scan of ``build_name`` (its intact pass and its layers' knockouts).
        Under pytest-xdist measured once per run: under a file lock in the shared run folder, the first
        process that needs it measures it and writes it there as JSON (exact floats), the others read it."""
        from ..record.store import baseline_path
        from .steps import frame_json, json_frame

        layers = self.shard_layers()[index]

        def measure():
            before, self.loaded.loading_for = self.loaded.loading_for, f"knockout shard {index + 1}/{self.shards}"
            try:
                return self._knockout_scan(build_name, None, layers)
            finally:
                self.loaded.loading_for = before

        def once():
            if self.loaded.run_folder is None:
                return measure()
            stem = baseline_path(".", self.loaded.model_name, build_name).stem
            name = f"{stem}.knockout-{index + 1}-of-{self.shards}.json"
            return self.loaded.run_folder.once(name, measure, dump=frame_json, load=json_frame)

        return self.loaded.memo(("knockout_shard", build_name, index), once)


def rung2_cost(m: BuildMeasurement, build_name: str, chosen, key_heads: Sequence[str]) -> tuple[float, float]:
    """Rung 2's counted FLOPs and seconds under the run's plan ``chosen``: the exact knockouts of
    ``key_heads`` (a gate's, plus the change screen's plain AtP when it is on), else the screened scan."""
    from ..rungs.plan import (
        calibrated_rate,
        exact_seconds,
        knockout_flops,
        rung2_seconds,
        screen_flops,
        screened_flops,
    )

    build, kp = m.loaded.build(build_name), m.loaded.settings.knockout_probe
    if key_heads:
        flops, seconds = knockout_flops(build, kp, heads=list(key_heads))["scan"], exact_seconds(build, kp, key_heads)
        if m.change_screen() is not None:  # plain AtP first; the exact part is then at most this
            atp = screen_flops(build, kp, "atp")
            flops, seconds = flops + atp, seconds + atp / calibrated_rate(build, kp, "screen")
        return flops, seconds
    assert chosen.top_k is not None
    method, variant = m.screen_method(build_name), rung2_plan.screen_variant(m.loaded.settings)
    return (
        screened_flops(build, kp, chosen.top_k, chosen.must_include, method, variant),
        rung2_seconds(build, kp, chosen.top_k, chosen.must_include, method, variant),
    )


def said_plan(m: BuildMeasurement, build_name: str, chosen) -> float:
    """Before a screened scan of every head starts: say its counted cost and time, return the seconds."""
    from ..rungs.plan import plan_estimate

    assert chosen.top_k is not None
    line, planned = plan_estimate(
        m.loaded.build(build_name),
        m.loaded.settings.knockout_probe,
        chosen.top_k,
        chosen.must_include,
        m.screen_method(build_name),
        rung2_plan.screen_variant(m.loaded.settings),
    )
    m.loaded.say(f"{line}; the full exact scan only with {flag('knockout-full')}")
    return planned


def said_took(
    m: BuildMeasurement, build_name: str, planned: float, took: float, what: str, frame=None, chosen=None, key_heads=()
) -> None:
    """After a plan chosen by size ran: say ``what``'s wall time ``took`` beside the estimate ``planned``;
    with the knockouts of ``frame``, beside the estimate for the heads it knocked out (`rungs.plan.replanned`:
    ``key_heads``, a gate's, else the screen's picks of the rung-2 plan ``chosen``, default the run's),
    and ``planned`` beside it, which counted the screen's picks at the longest replays."""
    from ..rungs.plan import replanned, took_line

    build = m.loaded.build(build_name)
    if frame is None:
        m.loaded.say(took_line(build, planned, took, what))
        return
    chosen = m.knockout_plan() if chosen is None else chosen
    ran = frame.attrs["exact_heads"]
    chose = replanned(
        build, m.loaded.settings.knockout_probe, planned, ran, key_heads, chosen.top_k, chosen.must_include
    )
    m.loaded.say(took_line(build, chose, took, what, before_s=planned))


def cleared_line(label: str, n_heads: int, frame, fraction: float) -> str:
    """What a screened gate's knockout stage says: how many key heads the change screen cleared."""
    exact = len(frame.attrs["exact_heads"])
    return (
        f"circuits: {label}: the change screen cleared {n_heads - exact} of {n_heads} key heads (estimated "
        f"change under {fraction:g} of its tolerance); {exact} knocked out exactly"
    )


AUTO_AUDIT_SHARD_CASES = 32  # under pytest-xdist, a slice of this many cases or more shards over the workers


def audit_shard_count(m: BuildMeasurement) -> int:
    """Case shards of the run's audit slice: under pytest-xdist with ``W`` workers, ``min(W, cases)`` for a
    slice of `AUTO_AUDIT_SHARD_CASES` cases or more (each shard its own test, which another worker may
    take, as a big model's knockout shards), else one."""
    chosen = m.loaded.settings.audit
    if chosen is None or m.loaded.workers <= 1 or len(chosen.cases) < AUTO_AUDIT_SHARD_CASES:
        return 1
    return min(m.loaded.workers, len(chosen.cases))


def measure_audit(m: BuildMeasurement, build_name: str):
    """Rung 3 of ``build_name``: the answers of the run's audit slice with every chunk present and with
    each removed (`rungs.audit.AuditFigures`), memoised in ``m.loaded``; the settings must name a slice.
    Sharded (`audit_shard_count`), the merge of its case shards (`audit_shard`)."""
    from ..rungs.audit import AuditFigures

    count = audit_shard_count(m)

    def measure():
        if count > 1:
            return AuditFigures.merged([audit_shard(m, build_name, i) for i in range(count)])
        return _audit_cases(m, build_name, None)

    return m.loaded.memo(("audit", build_name), measure)


def audit_shard(m: BuildMeasurement, build_name: str, index: int):
    """Case shard ``index`` of rung 3 on ``build_name`` (`rungs.audit.case_shards`). Under pytest-xdist
    measured once per run: the first process that needs it measures it under a file lock in the shared
    run folder and writes its figures there as JSON (exact floats); the others read them."""
    import json

    from ..record.store import baseline_path
    from ..rungs.audit import AuditFigures, case_shards

    s = m.loaded.settings
    assert s.audit is not None, "no audit slice in the settings"
    count = audit_shard_count(m)
    cases = case_shards(len(s.audit.cases), count)[index]

    def measure():
        return _audit_cases(m, build_name, cases, f" shard {index + 1}/{count}")

    def once():
        if m.loaded.run_folder is None:
            return measure()
        stem = baseline_path(".", m.loaded.model_name, build_name).stem
        name = f"{stem}.audit-{index + 1}-of-{count}.json"
        return m.loaded.run_folder.once(
            name,
            measure,
            dump=lambda figures: json.dumps(figures.section()),
            load=lambda text: AuditFigures.from_section(json.loads(text)),
        )

    return m.loaded.memo(("audit_shard", build_name, index), once)


def _audit_cases(m: BuildMeasurement, build_name: str, cases: range | None, shard: str = ""):
    """Rung 3 of the slice's cases at indices ``cases`` (None: every case) on ``build_name``, in a named phase."""
    from ..rungs.audit import audit_figures

    s = m.loaded.settings
    chosen = s.audit
    assert chosen is not None, "no audit slice in the settings"
    build = m.loaded.build(build_name)
    count = len(chosen.cases) if cases is None else len(cases)
    what = f"rung 3 (audit slice {chosen.path.name}{shard}, {count} cases) {m.loaded.model_name}:{build_name}"
    with m.loaded.phase(what):
        return audit_figures(build, chosen, s.batch_size, s.trust_remote_code, cases)
