"""Shared fixtures of the plugin's own tests: tiny models built locally, never downloaded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import scipy.stats  # noqa: F401  (below)

import pytest_circuits
from pytest_circuits.testing import TINY_FAMILIES, requires_embedded_model, requires_smollm2, save_tiny_model

pytest_plugins = ["pytester"]
# pytester drops from sys.modules what a test that uses it imported (test_fixtures: scipy.stats,
# through transformers), and scipy's C extensions cannot load twice in one process: a later gate's
# lazy import of scipy.stats then raised ImportError (test_first_hour failed when run after
# test_fixtures). Imported here, it is in every snapshot pytester restores.

FAMILIES = TINY_FAMILIES
needs_smollm2 = requires_smollm2()
needs_embedded = requires_embedded_model()
# the embedded model's fp32 baseline as it was recorded before the centred unembedding, the 32-draw
# null and per-sequence figures: an older record the gate must still read and compare like with like
LEGACY_BASELINE = Path(__file__).resolve().parent / "data" / "tiny-induction--fp32.legacy.json"


# The package under test as Python imports it (an editable checkout or a wheel in site-packages): tests
# read its files from here, never from this checkout's source tree, which a wheel install does not use.
PACKAGE = Path(pytest_circuits.__file__).resolve().parent
SHIPPED_BASELINES = PACKAGE / "baselines"
PROBES = PACKAGE / "probes"  # the packaged gate suite
IMPORT_ROOT = str(PACKAGE.parent)  # on a subprocess's PYTHONPATH: it imports this same package


def _shipped_digests() -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(SHIPPED_BASELINES.iterdir())}


@pytest.fixture(scope="session", autouse=True)
def shipped_baselines_untouched():
    """The package's shipped baselines are read only to every command: after the whole run (every
    test, every worker) each file is byte-identical and none was added or removed."""
    before = _shipped_digests()
    yield
    after = _shipped_digests()
    assert after == before, (
        f"the run wrote into {SHIPPED_BASELINES}: {sorted(set(after.items()) ^ set(before.items()))}"
    )


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """``tiny_folder(family, seed=0)``: a saved tiny random model folder, built once per session."""
    made = {}

    def make(family: str, seed: int = 0):
        key = (family, seed)
        if key not in made:
            made[key] = save_tiny_model(family, tmp_path_factory.mktemp(f"{family}-{seed}"), seed=seed)
        return made[key]

    return make


def read_v_heads_rolled(monkeypatch) -> None:
    """Corrupt the weight read on purpose: the separate Q/K/V layout returns the V heads rolled by one."""
    from pytest_circuits.model.families import QKV_LAYOUTS

    separate = QKV_LAYOUTS["separate"]

    def rolled(weights, geo):
        q, k, v = separate(weights, geo)
        return q, k, v.roll(1, dims=0)

    monkeypatch.setitem(QKV_LAYOUTS, "separate", rolled)


def beyond_progress(err: str) -> list[str]:
    """The lines of a CLI's stderr other than progress lines (a long phase on a busy machine writes
    ``loading m:fp32: 5s elapsed`` and ``...: done in 6s``)."""
    return [line for line in err.splitlines() if " elapsed" not in line and ": done in " not in line]


# --- tiny-induction as GGUF files, converted once per module ---------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private cache for the GGUF conversions of the module that asks (test_external_builds, test_llama_engine)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_CIRCUITS_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def float_gguf(env) -> Path:
    """tiny-induction as a float32 GGUF file (what the quantized files are made from)."""
    from pytest_circuits.model.gguf_quant import float_gguf_of

    return float_gguf_of("tiny-induction", env / "tiny-F32.gguf")


@pytest.fixture(scope="module")
def q8_file(env, float_gguf) -> Path:
    from pytest_circuits.model.gguf_quant import requantize_gguf

    return requantize_gguf(float_gguf, env / "tiny-Q8_0.gguf", "Q8_0")


@pytest.fixture
def record_validations(monkeypatch):
    """The class names of every `schema.Record` validation from here on, in order."""
    from pytest_circuits.record import schema

    validations: list[str] = []
    real = schema.Record.model_validate.__func__

    def counted(cls, *args, **kwargs):
        validations.append(cls.__name__)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(schema.Record, "model_validate", classmethod(counted))
    return validations


def attention_io(model, modules: list, ids) -> tuple[list[tuple], tuple]:
    """One forward of ``ids`` (batch 1): each attention module's ``(input, output)`` of sequence 0
    (float64, its first call) and the patterns the model returns (``output_attentions``)."""
    import torch

    seen: dict[int, tuple] = {}

    def keeper(index: int):
        def keep(module, args, kwargs, out) -> None:
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # RecurrentGemma: positional
            seen.setdefault(index, (x[0].double(), out[0][0].double()))

        return keep

    handles = [module.register_forward_hook(keeper(i), with_kwargs=True) for i, module in enumerate(modules)]
    try:
        with torch.no_grad():
            patterns = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    finally:
        for handle in handles:
            handle.remove()
    return [seen[i] for i in range(len(modules))], patterns


@pytest.fixture
def registry_restored():
    """The gate's registry as it was after the test (the modules it loads register invariants)."""
    from pytest_circuits.gate import invariant_api, invariants, user_invariants

    assert invariants.REGISTRY  # the built-in ones registered before the snapshot
    registry, declared = dict(invariant_api.REGISTRY), dict(invariant_api._DECLARED)
    modules = set(sys.modules)
    yield
    invariant_api.REGISTRY.clear()
    invariant_api.REGISTRY.update(registry)
    invariant_api._DECLARED.clear()
    invariant_api._DECLARED.update(declared)
    for name in set(sys.modules) - modules:
        if name.startswith("mod_") or name in user_invariants._ours:
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def tiny_fp32_builds(tmp_path_factory):
    """``make(model_type)``: the fp32 build of a tiny random model of that type (seed 2, initializer
    range 0.2), made once per test module."""
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model

    made = {}

    def make(model_type: str):
        if model_type not in made:
            folder = save_tiny_model(
                model_type, tmp_path_factory.mktemp(model_type) / "m", seed=2, initializer_range=0.2
            )
            made[model_type] = load_build(resolve_model(str(folder)), "fp32", "cpu")
        return made[model_type]

    return make


@pytest.fixture(scope="session")
def broken(tmp_path_factory):
    """The rung-3 and own-text tests' broken build: tiny-induction with its induction head L1H0's
    output zeroed, saved as a checkpoint (an external build)."""
    from transformers import AutoModelForCausalLM

    from pytest_circuits.model.named import named_model_path
    from pytest_circuits.run.sensitivity import scale_head_ov

    model = AutoModelForCausalLM.from_pretrained(str(named_model_path("tiny-induction")))
    scale_head_ov(model, 1, 0, 0.0)
    folder = tmp_path_factory.mktemp("broken") / "broken"
    model.save_pretrained(folder)
    return folder
