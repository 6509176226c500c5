"""The memoised measurement of one run's builds: each build loaded once, each figure (rung 1, the
repeat probe, the knockouts under the run's `rung2_plan`) computed once, and a failure remembered.

Light at import (the plugin may create one in any run): each method imports the layer it needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from . import rung2_plan
from .errors import renamed_keywords
from .options import flag
from .progress import stderr_line
from .settings import CircuitsSettings


class LoadedBuilds:
    """The memo of one run, its model (source, device, preflight) and each build loaded once."""

    NOT_FIGURES = ("preflight", "build", "written", "baseline")  # memo entries that outlive a weight edit

    def __init__(self, settings: CircuitsSettings, key_heads: Callable[[], Sequence[str]] = tuple):
        self.settings = settings
        self.key_heads = key_heads  # heads a screened scan always knocks out exactly (the baselines')
        self._cache: dict[tuple, Any] = {}
        self.loads: list[dict] = []  # {"recipe", "worker", "for"}: each build this process loaded
        self.worker: str | None = None  # the pytest-xdist worker id (gw0, ...), None in a plain run
        # the folder every process of one run shares (pytest-xdist): file locks, written-once markers,
        # knockout shards; None: one process, nothing to share
        self.shared_dir: Path | None = None
        self.workers = 1  # processes of this run (pytest-xdist's worker count)
        self._loading_for: str | None = None  # why a build is being loaded (a knockout shard), for the load count
        self.progress_write: Callable[[str], None] | None = None  # where long scans report (None: stderr)

    def memo(self, key: tuple, compute) -> Any:
        """``compute()`` once under ``key``. The one memo rule: a failure is remembered too and raised
        again (one message per run, no retries: a build that cannot load, or a baseline that is missing,
        is not loaded or logged a second time by every test that needs it)."""
        if key not in self._cache:
            try:
                self._cache[key] = compute()
            except Exception as error:
                self._cache[key] = _Failed(error)
        value = self._cache[key]
        if isinstance(value, _Failed):
            raise value.error
        return value

    def memoised(self, key: tuple) -> Any:
        """What ``key`` holds when it was computed without failing, else None."""
        value = self._cache.get(key)
        return None if isinstance(value, _Failed) else value

    @renamed_keywords(recipe="build_name")
    def forget_figures(self, build_name: str | None = None) -> None:
        """Drop the figures measured of ``build_name`` (None: of every build), keeping the loaded build:
        its weights were edited in place, or the probe settings changed (`pytest_circuits.sensitivity`).
        Every memo entry but `NOT_FIGURES` is a figure, so one added later is never kept stale."""
        self._cache = {
            k: v for k, v in self._cache.items() if k[0] in self.NOT_FIGURES or build_name not in (None, k[1])
        }

    @cached_property
    def source(self):
        """The model's weights folder (`model.loading.ModelSource`), resolved once, offline."""
        from .model.loading import resolve_model

        return resolve_model(self.settings.model)

    @property
    def model_name(self) -> str:
        """The model's name in baseline file names: ``settings.name``, else the source's."""
        return self.settings.name or self.source.name

    @cached_property
    def device(self):
        from .model.builds import resolve_device

        return resolve_device(self.settings.device, self.worker)

    def preflight(self):
        """The model's `Geometry`, its probe settings checked before any figure is computed
        (`measure_steps.preflight`: config and tokenizer only, seconds, not a scan)."""
        from .measure_steps import preflight

        return self.memo(("preflight",), lambda: preflight(self.settings, self.source, str(self.device)))

    @renamed_keywords(recipe="build_name")
    def build(self, build_name: str):
        """The loaded build ``build_name`` (`model.builds.LoadedBuild`): a recipe, or the NAME of an
        external build (``NAME=PATH``), with its KV cache when the build names one."""
        from .measure_steps import load_spec

        spec = self.settings.spec(build_name)
        self.preflight()

        def load():
            with self._phase(f"loading {self.model_name}:{build_name}"):
                build = load_spec(self.settings, self.source, spec, self.device)
            self.loads.append({"recipe": build_name, "worker": self.worker, "for": self._loading_for})
            return build

        return self.memo(("build", build_name), load)

    @renamed_keywords(recipe="build_name")
    def weights(self, build_name: str, fold: bool = True):
        """Per-head weights of a build (float32, dequantized, folded by default)."""
        from .model.weights import extract_weights

        return self.memo(("weights", build_name, fold), lambda: extract_weights(self.build(build_name).model, fold))

    def say(self, line: str) -> None:
        """One line to the run's progress writer (pytest's terminal), else to stderr."""
        (self.progress_write or stderr_line)(line)

    def _phase(self, label: str):
        """A heartbeat line every few seconds while a long step runs (`progress.phase`)."""
        from .progress import phase

        return phase(label, self.progress_write)

    @property
    def run_folder(self):
        """The run's shared folder (`fsio.RunFolder`) under pytest-xdist, else None."""
        from .fsio import RunFolder

        return None if self.shared_dir is None else RunFolder(self.shared_dir)


class BuildMeasurement(LoadedBuilds):
    """Memoises, per build: its rung 1, probe and knockout figures (the knockouts under the run's
    `rung2_plan`)."""

    @renamed_keywords(recipe="build_name")
    def ov_spectrum(self, build_name: str, method=None):
        """Rung 1: kappa of every head against the rotation null (DataFrame), measured by ``method``
        (a `rungs.kappa_method.KappaMethod`; default: the settings')."""
        from .measure_steps import measure_spectrum

        m = self.settings.kappa_method if method is None else method
        if m != m.null:  # flagged with a minimum effect: the scan without one, flagged again (no second null)
            from .rungs.kappa import reflagged

            return self.memo(
                ("ov_spectrum", build_name, m), lambda: reflagged(self.ov_spectrum(build_name, m.null), m.min_effect)
            )

        def measure():
            model = self.build(build_name).model
            with self._phase(f"rung 1 (kappa, {m.n_rotations} rotations) {self.model_name}:{build_name}"):
                return measure_spectrum(model, m, self.settings.fdr_q)

        return self.memo(("ov_spectrum", build_name, m), measure)

    @renamed_keywords(recipe="build_name")
    def repeat_probe(self, build_name: str):
        """Rung 1/2: copy losses and per-head routing scores on the seeded repeat probe."""
        from .rungs.probe import run_repeat_probe

        s = self.settings

        def measure():
            build = self.build(build_name)
            with self._phase(f"repeat probe (n={s.probe.n}, L={s.probe.L}) {self.model_name}:{build_name}"):
                if s.engine == "llama.cpp":
                    from .model.llama_engine import gguf_path, threads
                    from .rungs.llama_probe import llama_repeat_probe

                    spec = s.spec(build_name)  # preflight (`measure_steps.engine_files`) checked every build's file
                    path, kv = gguf_path(spec, s.model), spec.kv
                    return llama_repeat_probe(path, build.tokens, build.geometry, s.probe, kv, threads())
                return run_repeat_probe(build, s.probe, batch_size=s.batch_size)

        return self.memo(("repeat_probe", build_name), measure)

    @renamed_keywords(recipe="build_name")
    def head_knockout(self, build_name: str, heads=None):
        """Rung 2: knockout delta of every head (or of ``heads``) on held-out repeat sequences (DataFrame).
        Screened, the key heads (`key_heads`) are always knocked out exactly; with shards (`shards`),
        the scan of every head is the merge of its layer shards."""
        chosen = None if heads is None else tuple(sorted(heads))
        if chosen is None and self.settings.shard is not None:
            from .errors import ShardError

            i, k = self.settings.shard
            raise ShardError(
                f"this job measures only knockout shard {i}/{k} ({flag('shard')}): the whole scan of {build_name} "
                f"is the merge of every part ({flag('shard-parts')})"
            )
        if chosen is None and self.shards > 1:
            from .rungs.knockout_shards import merge_knockout_shards

            return self.memo(
                ("head_knockout", build_name, None),
                lambda: merge_knockout_shards([self.knockout_shard(build_name, i) for i in range(self.shards)]),
            )
        return self.memo(("head_knockout", build_name, chosen), lambda: self._knockout_scan(build_name, chosen, None))

    def scan_plan(self, build_name: str, knockout: bool, method) -> float | None:
        """Before a build's whole scan under a rung-2 plan chosen by size (and one process doing all of
        it): say its counted cost and time (`rungs.plan.scan_estimate`) and return the seconds; else None."""
        from .rungs.plan import scan_estimate, screened_flops

        s = self.settings
        measured = self.memoised(("ov_spectrum", build_name, method.null)) is not None
        if s.shard is not None or self.shards > 1 or measured:
            return None  # a shard's scan, or rung 1 already measured: not the whole scan's time
        chosen = rung2_plan.plan(s, self.preflight, lambda: list(self.key_heads()))
        if not chosen.by_size:
            return None
        build, rung2 = self.build(build_name), None
        if knockout:
            assert chosen.top_k is not None
            method_2 = self.screen_method(build_name)
            rung2 = screened_flops(
                build, s.knockout_probe, chosen.top_k, len(chosen.must_include), method_2, self.screen_variant()
            )
        line, seconds = scan_estimate(build, s.probe, method.n_rotations, rung2)
        self.say(line)
        return seconds

    def screen_top_k(self) -> int | None:
        """The rung-2 plan's K (`rung2_plan.screen_top_k`): None scans every head exactly."""
        return rung2_plan.screen_top_k(self.settings, self.preflight)

    @renamed_keywords(recipe="build_name")
    def screen_method(self, build_name: str) -> str:
        """How the screen ranks heads: ``--knockout-screen-method``, or by default (``auto``) atp*
        unless its counted cost passes the device's budget, then atp, said in one line."""
        if self.settings.knockout_screen_method != "auto":
            return self.settings.knockout_screen_method

        def choose():
            from .rungs.plan import automatic_screen_method

            method, why = automatic_screen_method(
                self.build(build_name), self.settings.knockout_probe, self.screen_variant()
            )
            if why:
                self.say(why)
            return method

        return self.memo(("screen_method", build_name), choose)

    def screen_variant(self):
        """The screen's knobs (`rungs.screen.ScreenVariant`) from the settings."""
        from .rungs.screen import ScreenVariant

        s = self.settings
        return ScreenVariant(
            sequences=s.knockout_screen_sequences,
            qk_top=s.knockout_screen_qk_top,
            grad_drop_layers=s.knockout_screen_grad_drop_layers,
            ablation=s.knockout_screen_ablation,
        )

    def _knockout_scan(self, build_name: str, heads, layers):
        from .rungs.knockout import knockout_scan
        from .rungs.plan import plan_estimate, took_line

        s = self.settings
        say = self.say
        chosen = rung2_plan.plan(s, self.preflight, lambda: list(self.key_heads()))
        planned = None
        if chosen.by_size and heads is None:  # said before it starts, with its counted cost
            assert chosen.top_k is not None
            line, planned = plan_estimate(
                self.build(build_name),
                s.knockout_probe,
                chosen.top_k,
                len(chosen.must_include),
                self.screen_method(build_name),
                self.screen_variant(),
            )
            say(f"{line}; the full exact scan only with {flag('knockout-full')}")
        started = time.perf_counter()
        frame = knockout_scan(
            self.build(build_name),
            s.knockout_probe,
            mode=s.knockout_mode,
            heads=None if heads is None else list(heads),
            screen_top_k=chosen.top_k,
            screen_method=self.screen_method(build_name),
            must_include=chosen.must_include,
            batch_size=s.batch_size,
            write=self.progress_write,
            layers=layers,
            screen_variant=self.screen_variant(),
        )
        if planned is not None:  # and after it, its wall time beside the estimate
            say(took_line(self.build(build_name), planned, time.perf_counter() - started))
        return frame

    @cached_property
    def shards(self) -> int:
        """Layer shards of a full knockout scan (`rung2_plan.shard_count`)."""
        return rung2_plan.shard_count(self.settings, self.workers, self.preflight)

    def shard_layers(self) -> list[list[int]]:
        """The layers of each shard (`rungs.knockout_shards.layer_shards`), from the model's config alone."""
        from .rungs.knockout_shards import layer_shards

        return layer_shards(self.preflight().n_layers, self.shards)

    @renamed_keywords(recipe="build_name")
    def knockout_shard(self, build_name: str, index: int):
        """Shard ``index`` of the knockout scan of ``build_name`` (its intact pass and its layers' knockouts).
        Under pytest-xdist measured once per run: under a file lock in the shared run folder, the first
        process that needs it measures it and writes it there as JSON (exact floats), the others read it."""
        from .gate.store import baseline_path
        from .measure_steps import frame_json, json_frame

        layers = self.shard_layers()[index]

        def measure():
            before, self._loading_for = self._loading_for, f"knockout shard {index + 1}/{self.shards}"
            try:
                return self._knockout_scan(build_name, None, layers)
            finally:
                self._loading_for = before

        def once():
            if self.run_folder is None:
                return measure()
            stem = baseline_path(".", self.model_name, build_name).stem
            name = f"{stem}.knockout-{index + 1}-of-{self.shards}.json"
            return self.run_folder.once(name, measure, dump=frame_json, load=json_frame)

        return self.memo(("knockout_shard", build_name, index), once)


class _Failed:
    """A memoised failure (`LoadedBuilds.memo`)."""

    def __init__(self, error: Exception):
        self.error = error
