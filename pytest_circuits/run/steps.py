"""The steps a `measurement.BuildMeasurement` memoises, as plain functions of their inputs: the
preflight check, loading one build, rung 1's kappa scan, and a knockout frame to and from JSON."""

from __future__ import annotations

from ..options import flag
from ..settings import CircuitsSettings


def preflight(settings: CircuitsSettings, source, device: str):
    """Check the model and the probe settings before any figure is computed; the `Geometry`.

    Reads the config and the tokenizer only (no weights): an unknown family, a probe that does not
    fit the model's context, or a build whose package or environment is missing
    (`model.requirements`) is refused in seconds, not after a scan.
    """
    from ..model.families import check_geometry, family_and_geometry
    from ..model.kv_formats import check_window_fits
    from ..model.loading import read_config
    from ..model.requirements import check_build_needs
    from ..model.vocab import token_info
    from ..rungs.repeat import bos_offset, check_fits, check_probe_memory, check_vocabulary

    s = settings
    config = read_config(source.folder, s.trust_remote_code, s.model)
    for spec in s.external:  # a NAME=PATH whose PATH is nowhere: one line now, not per test
        from ..model.external import check_external_path

        check_external_path(spec)
    names = dict.fromkeys((*s.builds, s.reference))
    for name in names:  # a package or environment a build needs: one line now, before the tokenizer is read
        check_build_needs(s.spec(name))
    tokens = token_info(source.folder, config, s.trust_remote_code)
    check_vocabulary(tokens)
    check_fits(config, tokens, s.probe.L)
    for name in names:  # a cache window the probe cannot exceed
        check_window_fits(s.spec(name), 2 * s.probe.L + bos_offset(tokens), flag("probe-length"))
    engine_files(s)
    if (
        s.probe.text is not None
    ):  # the own-text probe: a model that cannot read it, or too few passages, is one line now
        from ..rungs.text_probe import check_probe_text

        check_probe_text(source, tokens, s.probe, s.knockout_probe)
    if s.audit is not None:  # rung 3: a case this model cannot read (no tokenizer, over its context) is one line now
        from ..rungs.audit import check_slice

        check_slice(source, config, tokens, s.audit, s.trust_remote_code)
    _, geometry = family_and_geometry(config)
    check_geometry(s.model, geometry)
    if s.shard_parts is None:  # a merge job runs no probe: it gates the parts' figures
        from ..rungs.query_blocks import query_block

        T = 2 * s.probe.L + bos_offset(tokens)  # a probe run in blocks: its knockout pass checked as it starts
        knockout = query_block(geometry, min(s.batch_size, s.probe.n), T) >= T
        check_probe_memory(geometry, s.probe.n, s.probe.L, s.batch_size, knockout, device=device)
    return geometry


def load_spec(settings: CircuitsSettings, source, spec, device):
    """Load the build ``spec`` (a recipe or an external build) of ``source``, with its KV cache."""
    weights = spec.weights  # the build's weights; a KV cache is put in their attention after
    if weights.external:
        from ..model.external import load_external_build

        build = load_external_build(source, weights, device, settings.trust_remote_code)
    else:
        from ..model.builds import load_build

        build = load_build(source, weights.name, device, settings.trust_remote_code, device_map=settings.device_map)
    if settings.engine == "llama.cpp":  # llama.cpp runs the probe with its own cache; torch reads the weights only
        from ..model.llama_engine import served_by_llama

        build = served_by_llama(build, spec, settings.model)
    elif spec.kv is not None:
        from ..model.kv_cache import attach_kv_cache

        build = attach_kv_cache(build, spec.kv)
    return build


def engine_files(settings: CircuitsSettings) -> dict:
    """``{build: its GGUF file}`` with llama.cpp as the engine (``--circuits-engine llama.cpp``,
    `model.llama_engine`: every build gated must be one, with a cache llama.cpp takes, and
    llama-cpp-python installed); ``{}`` with torch."""
    if settings.engine != "llama.cpp":
        return {}
    from ..model.llama_engine import gguf_path, require_llama_cpp

    files = {name: gguf_path(settings.spec(name), settings.model) for name in settings.builds}
    require_llama_cpp()
    return files


def measure_spectrum(model, method, fdr_q: float):
    """Rung 1 of ``model``: kappa of every head against the rotation null, measured by ``method``
    (a `KappaMethod` without a minimum effect), one layer's weights at a time."""
    import torch

    from ..model.weights import StreamedWeights
    from ..rungs.kappa import ov_spectrum

    return ov_spectrum(
        StreamedWeights.of(model),  # one layer at a time: nothing held after
        n_rotations=method.n_rotations,
        q=fdr_q,
        seed=0,
        p_method=method.p_method,
        null_dtype=getattr(torch, method.null_dtype),
        unembedding=method.unembedding,
        min_effect=method.min_effect,
    )


def frame_json(frame) -> str:
    """A knockout frame as JSON (exact floats): its rows and its attrs."""
    import json

    return json.dumps({"rows": frame.to_dict("records"), "attrs": frame.attrs})


def json_frame(text: str):
    import json

    import pandas as pd

    saved = json.loads(text)
    frame = pd.DataFrame(saved["rows"])
    frame.attrs.update(saved["attrs"])
    return frame
