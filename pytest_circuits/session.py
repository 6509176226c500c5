"""One run's loaded builds and figures, computed once and shared by fixtures and the CLI.

Light at import (the plugin creates a session for every pytest run): each method imports
the layer it needs when first called.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from .options import flag
from .progress import stderr_line
from .settings import CircuitsSettings


class CircuitsSession:
    """Memoises, per build: the loaded build and its rung 1, probe and knockout figures."""

    def __init__(self, settings: CircuitsSettings):
        self.settings = settings
        self._cache: dict[tuple, Any] = {}
        self.loads: list[dict] = []  # {"recipe", "worker"}: each build this process loaded
        self.worker: str | None = None  # the pytest-xdist worker id (gw0, ...), None in a plain run
        # the folder every process of one run shares (pytest-xdist): file locks, written-once markers,
        # knockout shards; None: one process, nothing to share
        self.shared_dir: Path | None = None
        self.workers = 1  # processes of this run (pytest-xdist's worker count)
        self._loading_for: str | None = None  # why a build is being loaded (a knockout shard), for the load count
        # where long scans report progress (the plugin: its terminal reporter; None: stderr)
        self.progress_write: Callable[[str], None] | None = (
            None  # always knocked out exactly (e.g. a baseline file's key heads)
        )

    def memo(self, key: tuple, compute) -> Any:
        """``compute()`` once per session under ``key``. The one memo rule: a failure is remembered
        too and raised again (one message per session, no retries: a build that cannot load, or a
        baseline that is missing, is not loaded or logged a second time by every test that needs it)."""
        if key not in self._cache:
            try:
                self._cache[key] = compute()
            except Exception as error:
                self._cache[key] = _Failed(error)
        value = self._cache[key]
        if isinstance(value, _Failed):
            raise value.error
        return value

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
        """Check the model and the probe settings before any figure is computed; the `Geometry`.

        Reads the config and the tokenizer only (no weights): an unknown family, or a probe
        that does not fit the model's context, is refused in seconds, not after a scan.
        """

        def check():
            from .model.families import check_geometry, family_and_geometry
            from .model.loading import read_config
            from .model.vocab import token_info
            from .rungs.repeat import check_fits, check_probe_memory, check_vocabulary

            config = read_config(self.source.folder, self.settings.trust_remote_code, self.settings.model)
            s = self.settings
            for spec in s.external:  # a NAME=PATH whose PATH is nowhere: one line now, not per test
                from .model.external import check_external_path

                check_external_path(spec)
            tokens = token_info(self.source.folder, config, s.trust_remote_code)
            check_vocabulary(tokens)
            check_fits(config, tokens, s.probe.L)
            from .model.kv_formats import check_window_fits
            from .rungs.repeat import bos_offset

            for name in dict.fromkeys((*s.builds, s.reference)):  # a cache window the probe cannot exceed
                check_window_fits(s.spec(name), 2 * s.probe.L + bos_offset(tokens), flag("probe-length"))
            self.engine_files()
            _, geometry = family_and_geometry(config)
            check_geometry(self.settings.model, geometry)
            if s.shard_parts is None:  # a merge job runs no probe: it gates the parts' figures
                check_probe_memory(geometry, s.probe.n, s.probe.L, s.batch_size, knockout=True, device=str(self.device))
            return geometry

        return self.memo(("preflight",), check)

    @property
    def llama(self) -> bool:
        """True when llama.cpp runs the repeat probe (``--circuits-engine llama.cpp``, `model.llama_engine`)."""
        return self.settings.engine == "llama.cpp"

    def engine_files(self) -> dict:
        """``{build: its GGUF file}`` with llama.cpp as the engine (every build gated must be one,
        with a cache llama.cpp takes, and llama-cpp-python installed); ``{}`` with torch."""
        if not self.llama:
            return {}
        from .model.llama_engine import gguf_path, require_llama_cpp

        files = {name: gguf_path(self.settings.spec(name), self.settings.model) for name in self.settings.builds}
        require_llama_cpp()
        return files

    def build(self, recipe: str):
        """The loaded build ``recipe`` (`model.builds.LoadedBuild`) of the session's model: a recipe,
        or the NAME of an external build (``NAME=PATH``, `model.external.load_external_build`)."""
        from .model.builds import load_build

        spec = self.settings.spec(recipe)
        self.preflight()

        def load():
            with self._phase(f"loading {self.model_name}:{recipe}"):
                return loaded()

        def loaded():
            weights = spec.weights  # the build's weights; a KV cache is put in their attention after
            if weights.external:
                from .model.external import load_external_build

                build = load_external_build(self.source, weights, self.device, self.settings.trust_remote_code)
            else:
                s = self.settings
                build = load_build(self.source, weights.name, self.device, s.trust_remote_code, device_map=s.device_map)
            if self.llama:  # llama.cpp runs the probe with its own cache; torch reads the weights (kappa) only
                from .model.llama_engine import served_by_llama

                build = served_by_llama(build, spec, self.settings.model)
            elif spec.kv is not None:
                from .model.kv_cache import attach_kv_cache

                build = attach_kv_cache(build, spec.kv)
            self.loads.append({"recipe": recipe, "worker": self.worker, "for": self._loading_for})
            return build

        return self.memo(("build", recipe), load)

    NOT_FIGURES = ("preflight", "build", "written", "baseline")  # memo entries that outlive a weight edit

    def forget_figures(self, recipe: str | None = None) -> None:
        """Drop the figures measured of ``recipe`` (None: of every build), keeping the loaded build:
        its weights were edited in place, or the probe settings changed (`pytest_circuits.sensitivity`).
        Every memo entry but `NOT_FIGURES` is a figure, so one added later is never kept stale."""
        self._cache = {k: v for k, v in self._cache.items() if k[0] in self.NOT_FIGURES or recipe not in (None, k[1])}

    def identity_lines(self, recipe: str) -> list[str]:
        """``"external build q8 = dist/model-Q8_0.gguf (gguf, sha256 ..., tensors Q8_0 x12, F32 x5)"``
        for ``recipe`` and the reference, where they are external builds (gate messages, summary)."""
        from .errors import CircuitsError
        from .model.recipes import describe_identity

        lines = []
        for name in dict.fromkeys((recipe, self.settings.reference)):
            spec = self.settings.spec(name)
            if not (spec.external or spec.kv):
                continue
            try:
                if name != recipe:
                    identity = self.load_baseline(name)["build"]
                elif self.settings.shard_parts is not None:  # gated from its parts: the build is not loaded
                    identity = self.merged_record(name)["build"]
                else:
                    identity = self.build(name).identity.as_dict()
            except CircuitsError:
                continue  # the gate reports a missing or unreadable reference itself
            line = describe_identity(identity)
            if line:
                lines.append(f"{'reference ' if name != recipe else ''}{line}")
        return lines

    def weights(self, recipe: str, fold: bool = True):
        """Per-head weights of a build (float32, dequantized, folded by default)."""
        from .model.weights import extract_weights

        return self.memo(("weights", recipe, fold), lambda: extract_weights(self.build(recipe).model, fold))

    def ov_spectrum(self, recipe: str, method=None):
        """Rung 1: kappa of every head against the rotation null (DataFrame), measured by
        ``method`` (a `rungs.kappa_method.KappaMethod`; default: the settings')."""
        import torch

        from .model.weights import StreamedWeights
        from .rungs.kappa import ov_spectrum

        s = self.settings
        m = s.kappa_method if method is None else method
        if m != m.null:  # flagged with a minimum effect: the scan without one, flagged again (no second null)
            from .rungs.kappa import reflagged

            return self.memo(
                ("ov_spectrum", recipe, m), lambda: reflagged(self.ov_spectrum(recipe, m.null), m.min_effect)
            )

        def measure():
            weights = StreamedWeights.of(self.build(recipe).model)  # one layer at a time: nothing held after
            with self._phase(f"rung 1 (kappa, {m.n_rotations} rotations) {self.model_name}:{recipe}"):
                return ov_spectrum(
                    weights,
                    n_rotations=m.n_rotations,
                    q=s.fdr_q,
                    seed=0,
                    p_method=m.p_method,
                    null_dtype=getattr(torch, m.null_dtype),
                    unembedding=m.unembedding,
                    min_effect=m.min_effect,
                )

        return self.memo(("ov_spectrum", recipe, m), measure)

    def repeat_probe(self, recipe: str):
        """Rung 1/2: copy losses and per-head routing scores on the seeded repeat probe."""
        from .rungs.probe import run_repeat_probe

        s = self.settings

        def measure():
            build = self.build(recipe)
            with self._phase(f"repeat probe (n={s.probe.n}, L={s.probe.L}) {self.model_name}:{recipe}"):
                if self.llama:
                    from .model.llama_engine import threads
                    from .rungs.llama_probe import llama_repeat_probe

                    path, kv = self.engine_files()[recipe], s.spec(recipe).kv
                    return llama_repeat_probe(path, build.tokens, build.geometry, s.probe, kv, threads())
                return run_repeat_probe(build, s.probe, batch_size=s.batch_size)

        return self.memo(("repeat_probe", recipe), measure)

    def _phase(self, label: str):
        """A heartbeat line every few seconds while a long step runs (`progress.phase`)."""
        from .progress import phase

        return phase(label, self.progress_write)

    def head_knockout(self, recipe: str, heads=None):
        """Rung 2: knockout delta of every head (or of ``heads``) on held-out repeat sequences (DataFrame).

        With a screen, the key heads of this build's baselines are always knocked out exactly.
        With shards (`shards`), the scan of every head is the merge of its layer shards.
        """
        chosen = None if heads is None else tuple(sorted(heads))
        if chosen is None and self.settings.shard is not None:
            from .errors import ShardError

            i, k = self.settings.shard
            raise ShardError(
                f"this job measures only knockout shard {i}/{k} ({flag('shard')}): the whole scan of {recipe} "
                f"is the merge of every part ({flag('shard-parts')})"
            )
        if chosen is None and self.shards > 1:
            from .rungs.knockout_shards import merge_knockout_shards

            return self.memo(
                ("head_knockout", recipe, None),
                lambda: merge_knockout_shards([self.knockout_shard(recipe, i) for i in range(self.shards)]),
            )
        return self.memo(("head_knockout", recipe, chosen), lambda: self._knockout_scan(recipe, chosen, None))

    AUTO_SCREEN_HEADS = 300  # above this many heads the default rung-2 plan screens (SmolLM2-135M: 270, exact)
    AUTO_SCREEN_TOP_K = 12  # ... and knocks out the screen's top 12 exactly, plus the baselines' key heads

    def screen_top_k(self) -> int | None:
        """The rung-2 plan: exact knockouts of the screen's top K heads (and the baselines' key heads),
        or None for every head exactly. ``--knockout-screen K`` and ``--knockout-full`` choose; by
        default a model of more than `AUTO_SCREEN_HEADS` heads screens (its full exact scan is hours
        on a CPU: docs/scale.md), a smaller one is scanned exactly."""
        s = self.settings
        if s.knockout_screen is not None and s.knockout_full:
            from .errors import CircuitsError

            raise CircuitsError(
                f"{flag('knockout-full')} (every head exactly) and {flag('knockout-screen')} {s.knockout_screen} "
                "contradict each other; give one"
            )
        if s.knockout_screen is not None or s.knockout_full:
            return s.knockout_screen
        geometry = self.preflight()
        return self.AUTO_SCREEN_TOP_K if geometry.n_layers * geometry.n_heads > self.AUTO_SCREEN_HEADS else None

    def screen_method(self, recipe: str) -> str:
        """How the screen ranks heads: ``--knockout-screen-method``, or by default (``auto``) atp*
        unless its counted cost passes the device's budget, then atp, said in one line
        (`rungs.plan.automatic_screen_method`)."""
        chosen = self.settings.knockout_screen_method
        if chosen != "auto":
            return chosen

        def choose():
            from .rungs.plan import automatic_screen_method

            method, why = automatic_screen_method(self.build(recipe), self.settings.knockout_probe)
            if why:
                (self.progress_write or stderr_line)(why)
            return method

        return self.memo(("screen_method", recipe), choose)

    def _announce_plan(self, recipe: str, top_k: int, must_include) -> None:
        """Print the plan chosen by size and its counted cost before it starts (`rungs.plan.plan_line`)."""
        from .rungs.plan import plan_line

        s = self.settings
        line = plan_line(self.build(recipe), s.knockout_probe, top_k, len(must_include), self.screen_method(recipe))
        line += f"; the full exact scan only with {flag('knockout-full')}"
        (self.progress_write or stderr_line)(line)

    def _knockout_scan(self, recipe: str, heads, layers):
        from .rungs.knockout import knockout_scan

        s = self.settings
        top_k = self.screen_top_k()
        must_include = self.baseline_key_heads() if top_k is not None else ()
        if top_k is not None and s.knockout_screen is None and heads is None:
            self._announce_plan(recipe, top_k, must_include)
        return knockout_scan(
            self.build(recipe),
            s.knockout_probe,
            mode=s.knockout_mode,
            heads=None if heads is None else list(heads),
            screen_top_k=top_k,
            screen_method=self.screen_method(recipe),
            must_include=must_include,
            batch_size=s.batch_size,
            write=self.progress_write,
            layers=layers,
        )

    AUTO_SHARD_HEADS = 1024  # under xdist, models with this many heads or more shard their scan over the workers

    @cached_property
    def shards(self) -> int:
        """Layer shards of a full knockout scan: ``--circuits-knockout-shards`` (at most the layer count), else the worker count
        under pytest-xdist for a model of `AUTO_SHARD_HEADS` heads or more, else one; one when the
        knockouts come from shard parts (``--circuits-shard-parts``: nothing is measured)."""
        if self.settings.shard_parts is not None:
            return 1
        if self.settings.knockout_shards is not None:  # at most one shard per layer (4096 on 2 layers: 2)
            try:
                return max(1, min(self.settings.knockout_shards, self.preflight().n_layers))
            except Exception:  # the model cannot be gated: its tests say why
                return 1
        if self.workers <= 1:
            return 1
        try:
            geometry = self.preflight()
        except Exception:  # the model cannot be gated: its tests say why
            return 1
        return self.workers if geometry.n_layers * geometry.n_heads >= self.AUTO_SHARD_HEADS else 1

    def shard_layers(self) -> list[list[int]]:
        """The layers of each shard (`rungs.knockout_shards.layer_shards`), from the model's config alone."""
        from .rungs.knockout_shards import layer_shards

        return layer_shards(self.preflight().n_layers, self.shards)

    def knockout_shard(self, recipe: str, index: int):
        """Shard ``index`` of the knockout scan of ``recipe`` (its intact pass and its layers' knockouts).

        Under pytest-xdist a shard is measured once per run: under a file lock in the shared run
        folder, the first process that needs it measures it and writes it there as JSON (exact
        floats), every other one reads it.
        """
        layers = self.shard_layers()[index]

        def measure():
            before, self._loading_for = self._loading_for, f"knockout shard {index + 1}/{self.shards}"
            try:
                return self._knockout_scan(recipe, None, layers)
            finally:
                self._loading_for = before

        def once():
            if self.run_folder is None:
                return measure()
            name = f"{self.baseline_path(recipe).stem}.knockout-{index + 1}-of-{self.shards}.json"
            return self.run_folder.once(name, measure, dump=_frame_json, load=_json_frame)

        return self.memo(("knockout_shard", recipe, index), once)

    # ------------------------------------------------------------ baselines (gate/record.py, gate/store.py)

    def record(self, recipe: str, knockout: bool = True, method=None) -> dict:
        """The scan record of one build (`gate.record.build_record`), knockouts optional, kappa
        measured by ``method`` (default: the settings' `KappaMethod`)."""
        from .gate.record import build_record

        m = self.settings.kappa_method if method is None else method
        if self.settings.shard_parts is not None:
            return self.merged_record(recipe, m)
        full = self._cache.get(("record", recipe, True, m))
        if not knockout and full is not None and not isinstance(full, _Failed):  # the full record serves too
            return full
        return self.memo(("record", recipe, knockout, m), lambda: build_record(self, recipe, knockout, m))

    def merged_record(self, recipe: str, method=None) -> dict:
        """``--circuits-shard-parts``: the record of ``recipe`` merged from its shard parts
        (`gate.shards.merged_by_build`), read once; the build is not loaded. Parts of a build not
        gated, a build without parts, or parts measured otherwise than asked are one line each."""
        from .errors import ShardError
        from .gate.shards import merged_by_build, part_paths
        from .rungs.kappa_method import of_record

        said = flag("shard-parts")

        def read() -> dict[str, dict]:
            pattern = str(self.settings.shard_parts)
            merged = merged_by_build(part_paths(pattern, said))
            strays = sorted(set(merged) - set(self.settings.builds))
            if strays:
                raise ShardError(
                    f"{said} {pattern} holds parts of {', '.join(strays)}, not a build gated "
                    f"({', '.join(self.settings.builds)}): name only the parts of the builds gated"
                )
            for record in merged.values():
                if record["model"]["name"] != self.model_name:
                    raise ShardError(
                        f"{said} {pattern}: the parts are of model {record['model']['name']}, this run gates "
                        f"{self.model_name}: name the parts of this model"
                    )
                asked, theirs = self.settings.probe.as_dict(), {k: record["probe"].get(k) for k in ("seed", "n", "L")}
                if theirs != asked:
                    raise ShardError(
                        f"{said} {pattern}: the parts were measured with probe {theirs}, this run asks for {asked}; "
                        "give this run the shard jobs' probe options"
                    )
            return merged

        merged = self.memo(("shard_parts",), read)
        if recipe not in merged:
            raise ShardError(
                f"{said} {self.settings.shard_parts} holds no part of build {recipe}: "
                "gate only the builds whose parts are there, or add them"
            )
        record = merged[recipe]
        m = self.settings.kappa_method if method is None else method
        if of_record(record) != m:
            raise ShardError(
                f"the parts of {recipe} measured kappa with {of_record(record).describe()}, the baseline asks for "
                f"{m.describe()}: record the baseline again, or measure the build unsharded"
            )
        return record

    @cached_property
    def baselines(self):
        """This run's baseline book-keeping (`gate.baselines.RunBaselines`)."""
        from .gate.baselines import RunBaselines

        return RunBaselines(self)

    @property
    def run_folder(self):
        """The run's shared folder (`fsio.RunFolder`) under pytest-xdist, else None."""
        from .fsio import RunFolder

        return None if self.shared_dir is None else RunFolder(self.shared_dir)

    @property
    def store(self):
        return self.baselines.store

    @property
    def events(self) -> list[dict]:
        return self.baselines.events

    def baseline_path(self, recipe: str) -> Path:
        return self.baselines.path(recipe)

    def record_command(self, recipe: str) -> str:
        return self.baselines.record_command(recipe)

    def write_baseline(self, recipe: str) -> Path:
        return self.baselines.write(recipe)

    def load_baseline(self, recipe: str) -> dict:
        return self.baselines.load(recipe)

    def missing_message(self, recipe: str, path: Path) -> str:
        return self.baselines.missing_message(recipe, path)

    def pin_key_heads(self, heads) -> None:
        """Knock ``heads`` out exactly in every later screened scan of this session (`circuits gate`: the gated file's key heads)."""
        self.baselines.pinned_key_heads.update(heads)

    def baseline_key_heads(self) -> list[str]:
        return self.baselines.key_heads(self.tolerances)

    @cached_property
    def tolerances(self):
        """Gate tolerances: defaults, overridden by ini ``circuits_tol_*`` keys."""
        from .gate.tolerances import Tolerances

        return Tolerances().updated(self.settings.tolerances)


class _Failed:
    """A memoised failure (`CircuitsSession.memo`)."""

    def __init__(self, error: Exception):
        self.error = error


def _frame_json(frame) -> str:
    """A knockout frame as JSON (exact floats): its rows and its attrs."""
    import json

    return json.dumps({"rows": frame.to_dict("records"), "attrs": frame.attrs})


def _json_frame(text: str):
    import json

    import pandas as pd

    saved = json.loads(text)
    frame = pd.DataFrame(saved["rows"])
    frame.attrs.update(saved["attrs"])
    return frame
