"""A read that cannot be silently wrong (issue 25).

One resolution path for a config (`family_and_geometry`), used by the session, external builds,
the CLI and the plugin: `circuits scan` and ``pytest probes --circuits-model`` on types recognised
without a table entry. Checkpoints with missing or unexpected tensors are refused (folder,
external build, GGUF). The self-check covers the whole path: what the attention sublayer writes
into the residual stream, the embedding rows and the tail; an assumed layout is refused when the
block holds a module it never reads. The mutation table drops or changes every quirk each family
entry declares and requires the self-check to refuse each. Every added type and every type
recognised without an entry gets a kappa test: a hand-built copying head (+1) and suppressing head
(-1) whose fold is computed here from the module weights, read through a saved model's load path.
The gate's negligible-head cut reads what a head writes on the probe (``ov_gain x path_factor``),
so a layer that a norm on the attention output rescales keeps its heads.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pytest_circuits.cli import main
from pytest_circuits.errors import ModelLoadError
from pytest_circuits.model import families
from pytest_circuits.model.builds import load_build
from pytest_circuits.model.families import LLAMA, Family, family_and_geometry, family_of, geometry_of
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.selfcheck import DecompositionError, check_decomposition
from pytest_circuits.rungs.plain_loops import plain_kappa
from pytest_circuits.testing import make_tiny_model, save_tiny_model, tiny_config, tiny_model_types

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--device", "cpu", "--probe-n", "4", "--probe-length", "16"]
INFERRED_TYPES = ("arcee", "aria_text", "hunyuan_v1_dense", "seed_oss", "ernie4_5", "exaone")
"""Types of transformers 5.24 recognised without a table entry (the llama layout, confirmed by the
self-check); arcee runs in the default suite, the others with --run-slow."""


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


# ---------------------------------------------------------------- one resolution path


def test_family_and_geometry_of_a_config_is_the_loaded_models():
    for model_type in ("arcee", "llama", "gemma2"):
        model = make_tiny_model(model_type, seed=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            family, geometry = family_and_geometry(model.config)
        assert geometry == geometry_of(model)
        assert family.name == family_of(model).name and family.assumed == (model_type == "arcee")


def test_geometry_of_takes_a_model_not_a_stand_in():
    from types import SimpleNamespace

    with pytest.raises(TypeError, match="family_and_geometry"):
        geometry_of(SimpleNamespace(config=tiny_config("llama")))


def _unlisted_folder(model_type: str, tmp_path: Path) -> Path:
    if model_type in families.supported_model_types():
        pytest.fail(f"{model_type} is in the table now: take it out of INFERRED_TYPES")
    return save_tiny_model(model_type, tmp_path / "m", seed=1, initializer_range=0.2)


@pytest.mark.parametrize(
    "model_type", [t if t == "arcee" else pytest.param(t, marks=pytest.mark.slow) for t in INFERRED_TYPES]
)
def test_scan_on_a_type_without_a_table_entry(model_type, tmp_path):
    folder = _unlisted_folder(model_type, tmp_path)
    out = tmp_path / "scan.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["scan", str(folder), "--json", str(out), *SMALL]) == 0
    record = json.loads(out.read_text())
    assert (record["model"]["model_type"], record["model"]["family"]) == (model_type, "llama")  # type and layout
    geometry = record["model"]["geometry"]
    assert len(record["heads"]) == geometry["n_layers"] * geometry["n_heads"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("model_type", INFERRED_TYPES)
def test_plugin_on_a_type_without_a_table_entry(model_type, tmp_path):
    """``pytest probes --circuits-model`` (record, then gate against the record) in a fresh interpreter."""
    folder = _unlisted_folder(model_type, tmp_path)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "probes",
        "-p",
        "no:cacheprovider",
        "-q",
        f"--circuits-model={folder}",
        "--circuits-builds=fp32",
        f"--circuits-baselines={tmp_path / 'baselines'}",
        "--circuits-device=cpu",
        "--circuits-probe-n=4",
        "--circuits-probe-length=16",
    ]
    for extra in (["--circuits-update"], []):
        done = subprocess.run([*command, *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert "INTERNALERROR" not in done.stdout + done.stderr
    assert (tmp_path / "baselines" / "m--fp32.json").is_file()


# ---------------------------------------------------------------- missing or unexpected weights


def _drop_tensor(folder: Path, name: str, extra: str | None = None) -> None:
    weights = load_file(folder / "model.safetensors")
    del weights[name]
    if extra is not None:
        weights[extra] = torch.zeros(3)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_folder_missing_a_weight_is_refused(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m", seed=1)
    _drop_tensor(folder, "model.layers.1.self_attn.v_proj.weight")
    with pytest.raises(ModelLoadError) as error:
        load_build(resolve_model(str(folder)), "fp32", "cpu")
    line = _one_line(error)
    assert "1 tensor missing" in line and "model.layers.1.self_attn.v_proj.weight" in line


def test_unexpected_tensors_are_refused_and_tied_weights_are_not_missing(tmp_path):
    tied = save_tiny_model("llama", tmp_path / "tied", seed=1, tie_word_embeddings=True)
    load_build(resolve_model(str(tied)), "fp32", "cpu")  # lm_head shares the embedding: nothing missing
    folder = save_tiny_model("llama", tmp_path / "m", seed=1)
    _drop_tensor(folder, "model.layers.0.self_attn.o_proj.weight", extra="model.layers.0.self_attn.out.weight")
    with pytest.raises(ModelLoadError) as error:
        load_build(resolve_model(str(folder)), "fp32", "cpu")
    line = _one_line(error)
    assert "model.layers.0.self_attn.o_proj.weight" in line and "model.layers.0.self_attn.out.weight" in line


def test_an_external_build_missing_a_weight_is_refused(tmp_path):
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.recipes import BuildSpec

    model = save_tiny_model("llama", tmp_path / "m", seed=1)
    build = save_tiny_model("llama", tmp_path / "b", seed=1)
    _drop_tensor(build, "model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(ModelLoadError, match=r"1 tensor missing.*k_proj.weight"):
        load_external_build(resolve_model(str(model)), BuildSpec("ext", str(build)), "cpu")


def test_a_gguf_file_missing_a_tensor_is_refused(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from types import SimpleNamespace

    from pytest_circuits.model import gguf_cache
    from pytest_circuits.testing import write_tiny_gguf

    monkeypatch.setenv("PYTEST_CIRCUITS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "cache_root", lambda: tmp_path / "cache")
    model = make_tiny_model("llama", seed=1)
    state = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.self_attn.v_proj.weight"}
    path = write_tiny_gguf(SimpleNamespace(config=model.config, state_dict=lambda: state), tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError) as error:
        resolve_model(str(path))
    assert "v_proj.weight" in _one_line(error)


# ---------------------------------------------------------------- the whole path


def test_an_unread_norm_refuses_an_assumed_layout():
    """glm4 read as an assumed llama layout: its post_self_attn_layernorm is named, not skipped."""
    model = make_tiny_model("glm4", seed=2)
    assumed = dataclasses.replace(LLAMA, model_types=("glm4",), assumed=True)
    with pytest.raises(DecompositionError) as error:
        check_decomposition(model, family=assumed)
    assert "post_self_attn_layernorm" in _one_line(error) and "'glm4'" in str(error.value)


def test_a_missed_post_attention_norm_is_caught_by_the_residual_write():
    """The attention output alone matches; what the block adds to the residual does not."""
    model = make_tiny_model("glm4", seed=2)
    wrong = dataclasses.replace(family_of(model), post_attn_norm=None)
    with pytest.raises(DecompositionError) as error:
        check_decomposition(model, family=wrong)
    line = _one_line(error)
    assert "residual write" in line and "layer 0" in line and "'glm4'" in line


@pytest.mark.parametrize(
    "model_type, change, where",
    [
        ("granite", dict(embed_scale=None), "embedding rows"),
        ("cohere", dict(logit_scale=None), "tail"),
        ("gemma2", dict(logit_softcap=None), "tail"),
        ("llama", dict(norm_kind="layernorm"), "pre-attention norm"),
    ],
)
def test_the_tail_and_embedding_are_checked(model_type, change, where):
    model = make_tiny_model(model_type, seed=2, initializer_range=0.2, **VISIBLE.get(model_type, {}))
    assert check_decomposition(model).ok
    with pytest.raises(DecompositionError, match=where):
        check_decomposition(model, family=dataclasses.replace(family_of(model), **change))


# ---------------------------------------------------------------- the mutation table

VISIBLE = {
    "gemma2": dict(final_logit_softcapping=0.5),
    "gemma3_text": dict(final_logit_softcapping=0.5),
    "recurrent_gemma": dict(logits_soft_cap=0.5),
}
"""Config changes that make a quirk visible on a tiny model (a cap well below its logits)."""
_FUSED = ("fused_split", "fused_per_head", "fused_grouped")


def mutations(family: Family, config) -> list[tuple[str, dict]]:
    """Every quirk ``family`` declares, dropped or changed: ``[(what, dataclasses.replace changes)]``."""
    found: list[tuple[str, dict]] = []
    if family.attn_norm is not None:
        found.append(("drop the pre-attention norm", dict(attn_norm=None)))
    found.append(("swap the norm kind", dict(norm_kind="rmsnorm" if family.norm_kind == "layernorm" else "layernorm")))
    if "nonparametric_norm" not in family.quirks:
        found.append(("change the norm weight offset", dict(norm_weight_offset=1.0 - family.norm_weight_offset)))
    if family.post_attn_norm is not None:
        found.append(("drop the post-attention norm", dict(post_attn_norm=None)))
    if family.final_norm is not None:
        found.append(("drop the final norm", dict(final_norm=None)))
    if family.embed_scale or family.embed_norm is None:  # (a scale before an embedding norm cancels: no change)
        found.append(("drop/add the embedding scale", dict(embed_scale=None if family.embed_scale else "sqrt_d_model")))
    for field in (
        "embed_norm",
        "attn_out_multiplier",
        "attn_in_multiplier",
        "depth_scale",
        "beside",
        "beside_multiplier",
        "attention_blocks",
        "logit_scale",
        "logit_divisor",
        "logit_softcap",
        "attn_adds_residual",
    ):
        if getattr(family, field) is not None:
            found.append((f"drop {field}", {field: None}))
    geo = families.geometry_for(config, family)
    if family.qkv_layout in _FUSED:  # another packing of the same rows (one that reads the same rows is no change)
        same = families.qkv_rows(family.qkv_layout, geo)
        found += [
            (f"read Q/K/V as {other}", dict(qkv_layout=other))
            for other in _FUSED
            if other != family.qkv_layout and _rows_of(other, geo) != same
        ]
    elif family.latent_norm is not None:  # W_B's rows per head: d_nope key rows, then d_v value rows
        found.append(("read the latent's key columns as values", dict(d_head_attr="qk_nope_head_dim")))
        found.append(("read the query latent's norm as the kv latent's", dict(latent_norm="q_a_layernorm")))
    else:
        q, k, v = family.qkv
        found.append(("read V from the K projection", dict(qkv=(q, v, k))))
    if family.qkv_layout == "separate_gated":
        found.append(("drop the output gate", dict(qkv_layout="separate")))
    if family.multi_query_attr and geo.n_kv_heads == 1:
        found.append(("drop the multi-query flag", dict(multi_query_attr=None)))
    if family.n_kv_heads_attr and geo.n_kv_heads < geo.n_heads:
        found.append(("drop the GQA group map", dict(n_kv_heads_attr=None)))
    if family.is_parallel(config):  # (a sequential block read as parallel is measured the same: out - pre - mlp)
        found.append(("read a parallel block as sequential", dict(parallel=False)))
    return found


def _rows_of(layout: str, geo):
    try:
        return families.qkv_rows(layout, geo)
    except RuntimeError:  # the rows do not even split this way
        return None


def _entries() -> list[tuple[str, str]]:
    """``(entry label, tiny type)`` for every entry of the family table."""
    out = []
    for index, family in enumerate(families.FAMILIES):
        for name in tiny_model_types():
            config = tiny_config(name)
            if config.model_type in family.model_types and family.matches(config):
                out.append((f"{index}:{family.model_types[0]}", name))
                break
        else:
            out.append((f"{index}:{family.model_types[0]}", ""))
    return out


MUTATED_BY_DEFAULT = {
    *("gpt2", "gptj", "bloom", "falcon-new-decoder", "gpt_bigcode", "gemma2", "olmo2", "granite", "cohere"),
    *("glm4", "nemotron", "exaone4", "hyperclovax", "nanochat"),
    *("deepseek_v3", "qwen3_next", "falcon_h1", "nemotron_h", "minicpm3"),
}
"""Entries mutated in the default suite (one per mechanism, and the added types); all with --run-slow."""


@pytest.mark.parametrize(
    "entry, model_type",
    [e if e[1] in MUTATED_BY_DEFAULT else pytest.param(*e, marks=pytest.mark.slow) for e in _entries()],
)
def test_every_declared_quirk_dropped_is_refused(entry, model_type):
    assert model_type, f"no tiny model builds family entry {entry}"
    model = make_tiny_model(model_type, seed=5, initializer_range=0.2, **VISIBLE.get(model_type, {}))
    family = family_of(model)
    assert families.FAMILIES[int(entry.split(":")[0])] == family
    assert check_decomposition(model).ok
    missed = []
    for what, change in mutations(family, model.config):
        try:
            check_decomposition(model, family=dataclasses.replace(family, **change))
        except DecompositionError:
            continue
        missed.append(what)
    assert not missed, f"{entry}: the self-check let these through: {missed}"


# ---------------------------------------------------------------- added types: kappa of a hand-built head


@dataclasses.dataclass(frozen=True)
class HandFold:
    """How one model type's forward treats a head's direct path, written here from its modeling file."""

    pre: str | None = "input_layernorm"  # the norm the attention reads (None: the raw residual)
    post: str | None = None  # a norm on the attention output, before the residual add
    offset: float = 0.0  # every norm scales by offset + w (Nemotron's LayerNorm1P: 1 + w)
    centres: bool = False  # LayerNorm (centres) or RMSNorm (does not)
    weightless: bool = False  # norms without weight (nanochat); the final norm also runs on each embedding row


HAND_FOLD = {
    "glm4": HandFold(post="post_self_attn_layernorm"),
    "kolibri1": HandFold(post="post_self_attn_layernorm"),
    "nemotron": HandFold(offset=1.0, centres=True),
    "exaone4": HandFold(pre=None, post="post_attention_layernorm"),
    "cohere2": HandFold(centres=True),
    "cohere2_moe": HandFold(centres=True),
    "hyperclovax": HandFold(post="post_norm1"),
    "hyperclovax-no-post-norm": HandFold(),
    "nanochat": HandFold(pre=None, weightless=True),
    **{model_type: HandFold() for model_type in INFERRED_TYPES},
}
"""Every type the table gained for issue 25, and every type recognised without an entry (the llama
layout, assumed). Positive scalars (embedding, residual and logit multipliers, Cohere's logit scale)
are left out: they scale the reduced OV map and leave kappa alone."""
HAND_BY_DEFAULT = ("glm4", "nemotron", "exaone4", "cohere2", "hyperclovax", "nanochat", "arcee")
COPY, ANTI, HAND_LAYER = 0, 3, 1  # heads of different key/value groups, in the last layer


def _mixed_sign_scale(norm: torch.nn.Module, offset: float, generator: torch.Generator) -> np.ndarray:
    """Give ``norm`` an effective scale ``g = offset + w`` of mixed signs and returns ``g``: a missed
    ``g`` is then no positive congruence of the map, and moves kappa off +-1."""
    shape = norm.weight.shape
    g = (0.5 + torch.rand(shape, generator=generator)) * torch.where(
        torch.rand(shape, generator=generator) < 0.5, -1, 1
    )
    with torch.no_grad():
        norm.weight.copy_(g - offset)
    return g.double().numpy()


class _HandHead:
    """The fold of one model type's direct path ``W_E -> head -> W_U``, computed here from module weights."""

    def __init__(self, model, fold: HandFold):
        config, generator = model.config, torch.Generator().manual_seed(11)
        self.block, self.d_head = model.model.layers[HAND_LAYER], config.head_dim
        self.group_size = config.num_attention_heads // config.num_key_value_heads
        d = config.hidden_size
        self.C = np.eye(d) - np.full((d, d), 1.0 / d) if fold.centres else np.eye(d)
        ones = np.ones(d)
        pre = fold.pre and getattr(self.block, fold.pre)
        self.g = {
            "pre-attention norm": ones if pre is None else _mixed_sign_scale(pre, fold.offset, generator),
            "output norm": ones
            if fold.post is None
            else _mixed_sign_scale(getattr(self.block, fold.post), fold.offset, generator),
            "final norm": ones if fold.weightless else _mixed_sign_scale(model.model.norm, fold.offset, generator),
        }
        self.E = model.get_input_embeddings().weight.detach().double().numpy()
        self.rms_E = np.sqrt((self.E**2).mean(axis=1, keepdims=True) + config.rms_norm_eps) if fold.weightless else 1.0
        self.W_U = model.lm_head.weight.detach().double().numpy().T  # (d, vocab), as stored
        self.declared = {name for name, g in self.g.items() if g is not ones} | (
            {"embedding norm"} if fold.weightless else set()
        )

    def B(self, head: int, drop: str = "") -> np.ndarray:
        """``W_U W_E W_V`` folded (``d_model x d_head``), less the factor ``drop``."""
        g = {name: np.ones_like(v) if name == drop else v for name, v in self.g.items()}
        W_U = (self.C * g["final norm"]) @ self.W_U  # C diag(g_f) W_U
        W_U = W_U - W_U.mean(axis=1, keepdims=True)  # centred over the vocabulary
        W_E = self.E if drop == "embedding norm" else self.E / self.rms_E
        v_proj = self.block.self_attn.v_proj.weight.detach().double().numpy()
        group = head // self.group_size
        W_V = (self.C * g["pre-attention norm"]) @ v_proj[group * self.d_head : (group + 1) * self.d_head].T
        return (W_U @ W_E) @ W_V

    def set_head(self, head: int, sign: float) -> None:
        """Raw ``W_O`` of ``head`` such that its folded reduced OV map is ``sign B^T B``."""
        raw = sign * self.B(head).T / self.g["output norm"]  # the output norm multiplies each column by g_post
        with torch.no_grad():
            self.block.self_attn.o_proj.weight[:, head * self.d_head : (head + 1) * self.d_head] = torch.from_numpy(
                raw.T
            )

    def spectrum(self, drop: str = "") -> np.ndarray:
        """The copying head's eigenvalues over the largest's magnitude, by decreasing magnitude, as a
        read that misses ``drop`` would find them."""
        W_O = self.B(COPY).T / self.g["output norm"] * (1 if drop == "output norm" else self.g["output norm"])
        lam = np.linalg.eigvals(W_O @ self.B(COPY, drop))
        lam = lam[np.argsort(-np.abs(lam), kind="stable")]
        return lam / np.abs(lam[0])


@pytest.mark.parametrize(
    "model_type", [t if t in HAND_BY_DEFAULT else pytest.param(t, marks=pytest.mark.slow) for t in HAND_FOLD]
)
def test_kappa_of_hand_built_copying_and_suppressing_heads(model_type, tmp_path):
    """One head's W_O set so that its reduced OV map is ``B^T B`` (kappa +1), another's ``-B^T B``
    (kappa -1), with every fold factor computed here from the module weights by the model's own
    definition (not from `weights.py`); the model saved, loaded through the session (self-check
    included) and read by rung 1 must score them +1 and -1, and the copying head's spectrum must be
    the hand-built one up to a positive scalar (the multipliers). Each fold factor the type
    declares, missed, would move that spectrum by more than 0.01 (the test's power; the norm scales
    are given mixed signs, so a missed one also moves kappa off +1)."""
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    model = make_tiny_model(model_type, seed=7)
    hand = _HandHead(model, HAND_FOLD[model_type])
    hand.set_head(COPY, 1.0)
    hand.set_head(ANTI, -1.0)
    expected = hand.spectrum()
    assert plain_kappa(hand.B(COPY).T @ hand.B(COPY))[0] > 0.999 and np.abs(expected.imag).max() < 1e-9
    missed = {name: np.abs(hand.spectrum(name) - expected).max() for name in sorted(hand.declared)}
    assert missed and min(missed.values()) > 1e-2, missed  # each factor, missed, shows: 100x the tolerance below
    model.save_pretrained(tmp_path / model_type, safe_serialization=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an assumed layout says so in a warning
        session = Run(CircuitsSettings(model=str(tmp_path / model_type), device="cpu"))
        frame = session.measured.ov_spectrum("fp32").set_index("head")
    assert frame.loc[f"L{HAND_LAYER}H{COPY}", "kappa"] > 0.999
    assert frame.loc[f"L{HAND_LAYER}H{ANTI}", "kappa"] < -0.999
    assert frame.loc[f"L{HAND_LAYER}H{COPY}", "copying"] and frame.loc[f"L{HAND_LAYER}H{ANTI}", "suppression"]
    read = frame.attrs["eigenvalues"][HAND_LAYER, COPY]
    np.testing.assert_allclose(read / np.abs(read[0]), expected, rtol=0, atol=1e-4)  # up to positive scalars


def test_quirk_tags_are_the_ones_the_config_enables():
    """Gemma 3 declares soft caps its default config does not set; Gemma 2's sets both."""
    from transformers import CONFIG_MAPPING

    gemma3, gemma2 = CONFIG_MAPPING["gemma3_text"](), CONFIG_MAPPING["gemma2"]()
    tags3 = families.active_quirks(families.family_for_config(gemma3), gemma3)
    tags2 = families.active_quirks(families.family_for_config(gemma2), gemma2)
    assert "logit_softcap" not in tags3 and "attn_softcap" not in tags3 and "sandwich_norm" in tags3
    assert {"logit_softcap", "attn_softcap", "sandwich_norm"} <= set(tags2)
    no_window = CONFIG_MAPPING["mistral"](sliding_window=None)
    assert "sliding_window" not in families.active_quirks(families.family_for_config(no_window), no_window)


# ---------------------------------------------------------------- the negligible-head cut under sandwich norms


def _scan_record(model, folder: Path) -> dict:
    model.save_pretrained(folder, safe_serialization=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["scan", str(folder), "--json", str(folder / "scan.json"), *SMALL, "--no-knockout"]) == 0
    return json.loads((folder / "scan.json").read_text())


def test_the_negligible_head_cut_reads_what_a_head_writes_under_a_sandwich_norm(tmp_path):
    """Layer 0's W_O of a Gemma-2 model scaled by 0.005: the norm on the attention output undoes it,
    so the heads write what they wrote before, and the cut must not leave them out (the OV gain
    alone, the cut before, falls 200-fold and left all four out). Each layer's ``path_factor`` is
    recomputed here from the norms' inputs on the probe's tokens."""
    from pytest_circuits.gate.invariants import head_writes, negligible_heads
    from pytest_circuits.rungs.repeat import repeat_tokens

    records = {}
    for scale in (1.0, 0.005):
        model = make_tiny_model("gemma2", seed=3, initializer_range=0.2)
        with torch.no_grad():
            model.model.layers[0].self_attn.o_proj.weight.mul_(scale)
        records[scale] = _scan_record(model, tmp_path / f"x{scale}")
    intact, scaled = (head_writes(records[s])[0] for s in (1.0, 0.005))
    layer0 = {f"L0H{h}" for h in range(4)}
    for name in intact:
        assert scaled[name] == pytest.approx(intact[name], rel=0.02), name
    assert negligible_heads(records[0.005], 0.01) == negligible_heads(records[1.0], 0.01)
    assert not layer0 & negligible_heads(records[0.005], 0.01)
    gains = {row["head"]: row["ov_gain"] for row in records[0.005]["heads"]}
    assert all(gains[name] < 0.01 * max(gains.values()) for name in layer0)  # the old cut left them all out

    eps, seen = model.config.rms_norm_eps, {}
    hooks = [
        module.register_forward_pre_hook(lambda m, args, key=key: seen.__setitem__(key, args[0].detach().double()))
        for key, module in [("final", model.model.norm)]
        + [
            ((where, l), getattr(block, name))
            for l, block in enumerate(model.model.layers)
            for where, name in (("pre", "input_layernorm"), ("post", "post_attention_layernorm"))
        ]
    ]
    probe = records[0.005]["probe"]
    ids = repeat_tokens(
        load_build(resolve_model(str(tmp_path / "x0.005")), "fp32", "cpu").tokens, probe["n"], probe["L"], probe["seed"]
    )
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    inv = {k: 1 / (v[:, -2 * probe["L"] :].pow(2).mean(-1) + eps).sqrt() for k, v in seen.items()}
    for layer in range(2):
        expected = (inv["final"] * inv[("pre", layer)] * inv[("post", layer)]).mean().item()
        got = next(row["path_factor"] for row in records[0.005]["heads"] if row["head"] == f"L{layer}H0")
        assert got == pytest.approx(expected, rel=1e-5)


def test_the_residual_write_allows_the_rounding_of_the_sum_it_is_read_from():
    """A bfloat16 write read back as ``round(pre + write) - pre`` is off by up to ``u ||mid||``
    (SmolLM2-135M's later layers: 0.18 of the write, refused before in bf16): that much is allowed,
    and a wrong write (10% off) is still seen where the stream does not dwarf it."""
    from pytest_circuits.model.selfcheck import _relative, _relative_after_add

    g = torch.Generator().manual_seed(0)
    write = torch.randn(4, 16, 576, generator=g, dtype=torch.float64)
    for ratio, caught in ((45.0, False), (1.0, True)):
        pre = (ratio * torch.randn(4, 16, 576, generator=g, dtype=torch.float64)).bfloat16()
        mid = (pre.double() + write).bfloat16()  # the model's rounded residual add
        actual = mid.double() - pre.double()
        if ratio > 10:
            assert _relative(write, actual) > 0.03  # the plain relative error refuses a right read
        assert _relative_after_add(write, actual, mid) <= 0.03  # a right read passes
        wrong = _relative_after_add(1.1 * write, actual, mid)
        assert (wrong > 0.03) is caught, (ratio, wrong)
    mid32 = (pre.double() + write).float()  # float32: the allowance is negligible
    assert _relative_after_add(1.001 * write, mid32.double() - pre.double(), mid32) > 5e-4
