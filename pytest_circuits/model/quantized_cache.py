"""transformers' own ``QuantizedCache`` as a build's cache (``+kv-quanto-int4``, ``+kv-hqq-int4-r32``).

Not a simulation: the probe runs the build in decode mode (`rungs.query_blocks` with blocks of 1), one token at a
time with ``past_key_values=QuantizedCache(...)``, so every query reads the keys and values as the
cache stores them (its quantized part and its full-precision residual of at most
``residual_length`` tokens, which it flushes into the quantized part when full). The first token
is the prefill (it reads itself in full precision, as a server's first step does); every later
position is a decode step. ``-rN`` is ``residual_length``; without it the cache keeps its own
default (`kv_formats.QUANTIZED_CACHE_RESIDUAL`), what a user of ``QuantizedCache`` gets; the other
arguments (group size, axes) are the cache's own defaults.

The knockout scan and the attribution screen run one forward over the whole sequence; they refuse
such a build in one line (`refuse_decode_only`) rather than run it without its cache.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from importlib import metadata

import torch

from ..errors import RecipeError
from .kv_formats import KvSpec, decode_only

DECODE_ATTR = "_circuits_decode_cache"  # on the model: its `DecodeCache`
BACKEND_PACKAGES = {"quanto": ("optimum-quanto", "optimum.quanto"), "hqq": ("hqq", "hqq")}


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def require_backend(spec: KvSpec) -> str:
    """The package of a decode-mode cache's backend (``optimum-quanto``, ``hqq``), or a one-line
    `RecipeError` naming the install when it is missing."""
    backend = spec.format.backend or ""
    package, module = BACKEND_PACKAGES[backend]
    if not _installed(module):
        raise RecipeError(
            f"the {spec.name} cache runs transformers' QuantizedCache with its {backend} backend, which needs "
            f"the {package} package; install it (pip install {package}) or use another cache"
        )
    return package


class DecodeCache:
    """A build's ``QuantizedCache``: makes a fresh one per batch (`new`) and says what it is (`describe`)."""

    def __init__(self, spec: KvSpec, config):
        self.spec, self.config = spec, config
        self.package_version = metadata.version(require_backend(spec))

    def new(self):
        """An empty ``QuantizedCache`` for one batch of sequences."""
        from transformers.cache_utils import QuantizedCache

        try:
            return QuantizedCache(
                self.spec.format.backend or "",
                self.config,
                nbits=self.spec.format.bits,
                residual_length=self.spec.window or None,
            )
        except (ValueError, ImportError) as exc:
            raise RecipeError(
                f"the {self.spec.name} cache: transformers' QuantizedCache refuses this model: {exc}"
            ) from None

    def describe(self) -> str:
        import transformers
        from transformers.cache_utils import QuantizedLayer

        defaults = {k: v.default for k, v in inspect.signature(QuantizedLayer.__init__).parameters.items()}
        window = (
            f"residual_length {self.spec.window}"
            if self.spec.window
            else f"residual_length {defaults['residual_length']} (QuantizedCache's default)"
        )
        package = BACKEND_PACKAGES[self.spec.format.backend or ""][0]
        return (
            f"{self.spec.name}: {self.spec.format.summary} ({package} {self.package_version}); {window}, "
            f"q_group_size {defaults['q_group_size']}, axis_key {defaults['axis_key']}, axis_value "
            f"{defaults['axis_value']}; transformers {transformers.__version__}, run in decode mode (one token at a time)"
        )


def decode_cache_of(model) -> DecodeCache | None:
    """The `DecodeCache` a model serves, or None."""
    return getattr(model, DECODE_ATTR, None)


def refuse_decode_only(build, what: str) -> None:
    """One line instead of running ``what`` (one forward over whole sequences) without the build's cache."""
    cache = decode_cache_of(build.model)
    if cache is not None:
        raise decode_only(build.recipe, cache.spec.name, what)


@torch.no_grad()
def check_in_path(model, cache: DecodeCache, n_layers: int, what: str) -> None:
    """Refuse a model whose layers do not all store two decode steps in the ``QuantizedCache``."""
    device = model.get_input_embeddings().weight.device
    past = cache.new()
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for _ in range(2):  # a prefill of one token, then one decode step
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True, **{name: past})
    stored = [layer for layer in range(n_layers) if layer < len(past.layers) and past.get_seq_length(layer) == 2]
    if len(stored) != n_layers:
        raise RecipeError(
            f"{what}: {model.config.model_type} did not store its keys and values in transformers' QuantizedCache "
            "in every layer, so the cache cannot be gated on it; gate it without +kv-"
        )


def attach_quantized_cache(build, spec: KvSpec):
    """``build`` served with transformers' ``QuantizedCache`` ``spec``: a new `LoadedBuild` named
    ``NAME+kv-SPEC`` whose identity names the cache, its backend and their versions."""
    what = f"build {build.recipe}+kv-{spec.name}"
    if build.identity.kv_cache:
        raise RecipeError(
            f"{what}: {build.recipe} already serves a KV cache ({build.identity.kv_cache.partition(';')[0]}, declared by "
            f"its checkpoint); gate it without +kv-{spec.name}"
        )
    model = build.model
    cache = DecodeCache(spec, model.config)
    setattr(model, DECODE_ATTR, cache)
    check_in_path(model, cache, build.geometry.n_layers, what)
    identity = replace(build.identity, recipe=f"{build.identity.recipe}+kv-{spec.name}", kv_cache=cache.describe())
    return replace(build, identity=identity)
