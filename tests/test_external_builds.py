"""External builds (``--circuits-builds fp32,q8=FILE``): GGUF files made here with the ``gguf``
package's own quantizers, gated against fp32; bad NAME=PATH specs are one line each.

Fast tests use the embedded tiny-induction model; the SmolLM2-135M ones are ``real`` and ``slow``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pytest_circuits.errors import ModelLoadError, RecipeError
from pytest_circuits.settings import build_settings

from .conftest import needs_embedded, needs_smollm2

pytestmark = needs_embedded

INVARIANTS = ("copying_heads", "kappa_distribution", "copy_loss", "induction_heads", "knockout_deltas")
FIXES = {"own": "OWN FIX", "reference": "REF FIX"}


def one_line(error) -> str:
    text = str(error.value if hasattr(error, "value") else error)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def file_types(path: Path) -> dict[str, int]:
    """Tensor types of a GGUF file, read independently of the code under test."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


def settings(builds: str, reference: str = "fp32", baselines: Path | None = None, **fixed):
    raw = {"builds": builds, "reference": reference, "baselines": baselines}
    return build_settings(raw, Path("baselines"), **fixed)


# ---------------------------------------------------------------- NAME=PATH specs


@pytest.mark.parametrize(
    "builds, says",
    [
        ("fp32,q8=", "names no path"),
        ("fp32,bf16=model.gguf", "'bf16' is a recipe name"),
        ("fp32,my model=model.gguf", "must be file-name safe"),
        ("fp32,a--b=model.gguf", "must be file-name safe"),
        ("fp32,../x=model.gguf", "must be file-name safe"),
        ("q8=a.gguf,q8=b.gguf", "given twice"),
        ("fp32,nope", "NAME=PATH"),
    ],
)
def test_bad_build_specs_are_one_line(builds, says):
    with pytest.raises(RecipeError) as error:
        settings(builds)
    assert says in one_line(error)


def test_specs_are_parsed_once_into_names_and_paths():
    s = settings(" fp32 , q8=dist/m-Q8_0.gguf, fp32", reference="q8")
    assert s.builds == ("fp32", "q8") and s.reference == "q8"
    assert str(s.spec("q8")) == "q8=dist/m-Q8_0.gguf" and s.spec("fp32").path is None
    s = settings("fp32", reference="ref=dist/m-F16.gguf")  # a reference that is not tested itself
    assert s.spec(s.reference).path == "dist/m-F16.gguf"
    with pytest.raises(RecipeError) as error:
        settings("fp32,q8=a.gguf", reference="q8=b.gguf")
    assert "given twice" in one_line(error)


def test_missing_path_is_one_line_before_anything_loads(tmp_path, capsys):
    from pytest_circuits.cli import main

    missing = tmp_path / "absent-Q8_0.gguf"
    assert main(["scan", "tiny-induction", "--build", f"q8={missing}", "--no-knockout"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"q8={missing}" in err and "does not exist" in err


def test_baseline_file_name_is_the_name(tmp_path):
    from pytest_circuits.run.run import Run

    session = Run(settings("fp32,q8=x.gguf", baselines=tmp_path))
    assert session.baselines.path("q8") == tmp_path / "tiny-induction--q8.json"
    assert "--build q8=x.gguf" in session.baselines.record_command("q8")


# ---------------------------------------------------------------- refusals of the file itself


def test_other_geometry_is_refused_in_one_line(env):
    from pytest_circuits.run.run import Run
    from pytest_circuits.testing import make_tiny_model, write_tiny_gguf

    other = write_tiny_gguf(make_tiny_model("llama", seed=3), env / "other-shape.gguf")
    session = Run(settings(f"fp32,other={other}", device="cpu"))
    with pytest.raises(RecipeError) as error:
        session.loaded.build("other")
    text = one_line(error)
    assert "geometry" in text and "tiny-induction" in text and "n_layers 2" in text


def test_unsupported_tensor_type_is_one_line_naming_it(env, float_gguf):
    """Q8_K is a type gguf has no dequantizer for: the file is refused naming the tensor and the type."""
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.gguf_quant import requantize_gguf
    from pytest_circuits.model.loading import dequantizable_types, resolve_model
    from pytest_circuits.model.recipes import BuildSpec

    assert "Q8_K" not in dequantizable_types()
    raw = np.zeros((128, 292), dtype=np.uint8)  # one Q8_K block (292 bytes) per 256-wide row of ffn_down
    path = requantize_gguf(float_gguf, env / "q8k.gguf", "F32", blocks={"blk.0.ffn_down.weight": ("Q8_K", raw)})
    assert file_types(path)["Q8_K"] == 1
    with pytest.raises(ModelLoadError) as error:
        load_external_build(resolve_model("tiny-induction"), BuildSpec("q8k", str(path)), "cpu")
    text = one_line(error)
    assert "blk.0.ffn_down.weight" in text and "Q8_K" in text and text.startswith("external build q8k=")


def test_k_quant_tensor_loads_through_dequantization(env, float_gguf):
    """gguf cannot write k-quants; a Q6_K tensor written as raw blocks loads as its dequantization."""
    import gguf

    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.gguf_quant import quantizable_types, requantize_gguf
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import BuildSpec

    assert "Q6_K" not in quantizable_types()
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(128, 210), dtype=np.uint8)  # Q6_K: ql[128] qh[64] scales[16] d(f16)
    raw[:, 192:208] = rng.integers(-8, 8, size=(128, 16)).astype(np.int8).view(np.uint8)
    raw[:, 208:210] = np.full((128, 1), 2e-3, dtype=np.float16).view(np.uint8)
    name = "blk.0.ffn_down.weight"
    path = requantize_gguf(float_gguf, env / "q6k.gguf", "Q8_0", blocks={name: ("Q6_K", raw)})
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)
    assert expected.shape == (128, 256) and np.isfinite(expected).all() and expected.std() > 0
    build = load_external_build(resolve_model("tiny-induction"), BuildSpec("q6k", str(path)), "cpu")
    loaded = build.model.model.layers[0].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_array_equal(loaded, expected)
    assert build.identity.tensor_types == file_types(path) == {"Q8_0": 14, "Q6_K": 1, "F32": 5}


# ---------------------------------------------------------------- a real Q8_0 file, gated


@pytest.fixture(scope="module")
def q8_session(q8_file, tmp_path_factory):
    from pytest_circuits.run.run import Run

    return Run(settings(f"fp32,q8={q8_file}", device="cpu"))


def test_q8_file_identity_is_the_file(q8_session, q8_file):
    from pytest_circuits.record.schema import Record

    record = q8_session.records.record("q8", knockout=False).data
    build = record["build"]
    assert build["recipe"] == "q8" and build["source"] == str(q8_file) and build["format"] == "gguf"
    assert build["sha256"] == hashlib.sha256(q8_file.read_bytes()).hexdigest()
    # what the file holds, read by gguf's reader: 14 projections and the embedding at Q8_0, 5 norms F32
    assert build["tensor_types"] == file_types(q8_file) == {"Q8_0": 15, "F32": 5}
    Record.model_validate(json.loads(json.dumps(record)))
    fp32 = q8_session.records.record("fp32", knockout=False).data["build"]
    assert not set(fp32) & {"source", "format", "sha256", "tensor_types"}  # recipe builds: as before


def test_q8_file_passes_the_gate_against_fp32(q8_session, q8_file):
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.run.flow import gate_build

    for invariant in INVARIANTS:
        outcome = gate_build(q8_session.records, q8_session.baselines, "q8", invariant, Tolerances(), FIXES)
        assert outcome.passed, outcome.message()
        assert [r.against for r in outcome.results] == ["fp32 baseline"]  # no own baseline shipped: drift skipped
    line = q8_session.identity_lines("q8")[0]
    assert str(q8_file) in line and "Q8_0 x15" in line and hashlib.sha256(q8_file.read_bytes()).hexdigest()[:12] in line
    fp32, q8 = (
        q8_session.records.record("fp32", knockout=False).data,
        q8_session.records.record("q8", knockout=False).data,
    )
    assert q8["copy_loss"] != fp32["copy_loss"]  # the file's weights are really not the float ones


def test_report_shows_the_file_of_an_external_build(q8_session, q8_file, tmp_path):
    pytest.importorskip("matplotlib", reason="the report draws with matplotlib")
    from pytest_circuits.report import write_report

    page = write_report(tmp_path, [q8_session.records.record("q8", knockout=False).data]).read_text()
    assert hashlib.sha256(q8_file.read_bytes()).hexdigest() in page and str(q8_file) in page and "Q8_0" in page


def test_shipped_baselines_still_validate():
    from pytest_circuits.model.named import SHIPPED_BASELINES
    from pytest_circuits.record.store import BaselineStore

    store = BaselineStore(SHIPPED_BASELINES)
    for model in ("tiny-induction", "smollm2-135m"):
        for build in store.builds(model):
            assert "format" not in store.read(model, build).build.model_fields_set


def test_record_then_gate_against_an_external_reference(q8_session, q8_file, tmp_path, capsys):
    """``circuits record --build q8=FILE`` writes ``<model>--q8.json``; fp32 gated with
    ``--circuits-reference q8`` names the reference file in its notes."""
    from pytest_circuits.cli import main
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.run.flow import gate_build
    from pytest_circuits.run.run import Run

    assert main(["record", "tiny-induction", "--build", f"q8={q8_file}", "--baselines", str(tmp_path)]) == 0
    written = tmp_path / "tiny-induction--q8.json"
    assert f"wrote {written}" in capsys.readouterr().out
    stored = json.loads(written.read_text())["build"]
    assert stored["sha256"] == hashlib.sha256(q8_file.read_bytes()).hexdigest() and stored["tensor_types"]["Q8_0"] == 15
    assert main(["gate", "tiny-induction", "--build", f"q8={q8_file}", "--baseline", str(written)]) == 0
    out = capsys.readouterr().out
    assert f"candidate external build q8 = {q8_file} (gguf" in out and f"baseline external build q8 = {q8_file}" in out
    session = Run(settings(f"fp32,q8={q8_file}", reference="q8", baselines=tmp_path, device="cpu"))
    session.loaded._cache.update({k: v for k, v in q8_session.loaded._cache.items() if k[0] in ("build", "weights")})
    outcome = gate_build(session.records, session.baselines, "fp32", "copying_heads", Tolerances(), FIXES)
    assert outcome.passed and outcome.results[0].against == "q8 baseline", outcome.message()
    assert any(line.startswith("reference external build q8 = ") for line in session.identity_lines("fp32"))


# ---------------------------------------------------------------- SmolLM2-135M (real, slow)


@pytest.mark.slow
@pytest.mark.real
@needs_smollm2
@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_smollm2_requantized_file_keeps_its_tokenizer_and_shape(env, tensor_type):
    """The shipped Q4_1 file re-stored at another type: same metadata and tensors, new types."""
    import gguf

    from pytest_circuits.model.gguf_quant import cached_gguf
    from pytest_circuits.model.named import named_model_path

    shipped = named_model_path("smollm2-135m")
    made = cached_gguf("smollm2-135m", tensor_type)
    a, b = gguf.GGUFReader(str(shipped)), gguf.GGUFReader(str(made))
    assert a.fields["tokenizer.ggml.tokens"].contents() == b.fields["tokenizer.ggml.tokens"].contents()
    assert [(t.name, list(t.shape)) for t in a.tensors] == [(t.name, list(t.shape)) for t in b.tensors]
    assert file_types(made) == {tensor_type: 211, "F32": 61}


@pytest.mark.slow
@pytest.mark.real
@needs_smollm2
def test_smollm2_q8_file_passes_the_gate_against_fp32(env):
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.model.gguf_quant import cached_gguf
    from pytest_circuits.run.flow import gate_build
    from pytest_circuits.run.run import Run

    q8 = cached_gguf("smollm2-135m", "Q8_0")
    s = build_settings(
        {"model": "smollm2-135m", "builds": f"fp32,q8={q8}", "knockout-screen": "12"}, Path("baselines"), device="cpu"
    )
    session = Run(s)
    for invariant in ("copying_heads", "copy_loss", "induction_heads"):
        outcome = gate_build(session.records, session.baselines, "q8", invariant, Tolerances(), FIXES)
        assert outcome.passed, outcome.message()
    assert session.records.record("q8", knockout=False).data["build"]["tensor_types"] == file_types(q8)


# ---------------------------------------------------------------- pre-quantized checkpoints (slow)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, fmt", [("bnb-int8", "bnb-8bit-serialized"), ("bnb-nf4", "bnb-4bit-nf4-serialized")])
def test_bnb_serialized_checkpoint_is_the_recipe_build(tmp_path, recipe, fmt):
    """A bitsandbytes checkpoint saved with save_pretrained loads on CPU as an external build and
    gives the figures of the recipe build it was saved from (same codes, same scales)."""
    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.probe import run_repeat_probe

    session = Run(settings(recipe, device="cpu"))
    session.loaded.build(recipe).model.save_pretrained(tmp_path / "saved", safe_serialization=True)
    external = Run(settings(f"{recipe},saved={tmp_path / 'saved'}", device="cpu"))
    build = external.loaded.build("saved")
    assert build.identity.format == fmt and build.llm_int8 == (recipe == "bnb-int8")
    assert "U8" in build.identity.tensor_types  # the codes are stored quantized, not as floats
    ours = run_repeat_probe(build, session.settings.probe).model_figures()
    theirs = session.measured.repeat_probe(recipe).model_figures()
    for name in ("copy_loss", "first_copy_loss"):
        assert ours[name] == pytest.approx(theirs[name], abs=1e-5)


@pytest.mark.slow
def test_torchao_int8_checkpoint_loads_when_torchao_is_installed(tmp_path):
    """torchao's int8 weight-only checkpoint loads on CPU; its Int8Tensor weights are read dequantized."""
    pytest.importorskip("torchao", reason="torchao is not installed (an optional checkpoint format)")
    import torch
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.run.run import Run

    config = TorchAoConfig(quant_type=Int8WeightOnlyConfig())
    folder = resolve_model("tiny-induction").folder
    net = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.float32)
    net.save_pretrained(tmp_path / "ao", safe_serialization=True)
    session = Run(settings(f"fp32,ao={tmp_path / 'ao'}", device="cpu"))
    build = session.loaded.build("ao")
    assert build.identity.format == "torchao" and "I8" in build.identity.tensor_types
    fp32, ao = (
        session.measured.repeat_probe("fp32").model_figures(),
        session.measured.repeat_probe("ao").model_figures(),
    )
    assert ao["copy_loss"] != fp32["copy_loss"] and abs(ao["copy_loss"] - fp32["copy_loss"]) < 0.05
