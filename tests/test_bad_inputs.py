"""Bad inputs and filesystem faults of the model side (issue 16), one table row each.

Every row builds its bad input under ``tmp_path`` and runs ``circuits scan`` on it. The
default run calls ``cli.main`` in this process (fast: torch is imported once); the same
table runs ``python -m pytest_circuits.cli`` in a subprocess under ``--run-slow``. Each row
asserts the exit status, that stderr is exactly one line naming the thing (an error for
rc 2, a warning for rc 0), that no traceback appears, and that a good ``--json`` file
already in place is byte-identical afterwards.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pytest_circuits import cli
from pytest_circuits.model.loading import MARKER, cache_entry_problem
from pytest_circuits.testing import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--no-knockout", "--probe-n", "2", "--probe-length", "8", "--device", "cpu"]
GOOD_JSON = b'{"a good scan record": "already in place"}\n'


# ---------------------------------------------------------------- bad inputs, written here


class Unpickled:
    """A pickle that leaves a marker file when unpickled (it proves code ran)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def write_marker_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(Unpickled(marker)))


def tiny_llama(folder: Path, **overrides) -> Path:
    return save_tiny_model("llama", folder, **overrides)


def edit_weights(folder: Path, edit) -> None:
    """Apply ``edit(state_dict)`` to ``model.safetensors`` in place."""
    file = folder / "model.safetensors"
    state = load_file(file)
    edit(state)
    save_file(state, file, metadata={"format": "pt"})


def set_values(name: str, value: float, count: int):
    def edit(state):
        flat = state[name].view(-1)
        flat[torch.arange(count) * 7] = value  # distinct entries

    return edit


def write_tiny_gguf(
    path: Path,
    seed: int = 0,
    vocab: int = 64,
    d: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv: int = 2,
    ff: int = 64,
    ctx: int = 64,
    q_type: str | None = None,
) -> Path:
    """A tiny llama GGUF file (float32 tensors; ``q_type`` gives ``blk.0.attn_q.weight`` that raw type)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(ctx)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(d // heads)
    writer.add_vocab_size(vocab)
    dh = d // heads

    def tensor(name, shape):
        writer.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", (vocab, d))
    for i in range(layers):
        if i == 0 and q_type is not None:
            kind = gguf.GGMLQuantizationType[q_type]
            block, size = gguf.GGML_QUANT_SIZES[kind]
            raw = np.zeros((heads * dh, d // block * size if d >= block else size), dtype=np.uint8)
            writer.add_tensor(f"blk.{i}.attn_q.weight", raw, raw_dtype=kind)
        else:
            tensor(f"blk.{i}.attn_q.weight", (heads * dh, d))
        tensor(f"blk.{i}.attn_norm.weight", (d,))
        tensor(f"blk.{i}.ffn_norm.weight", (d,))
        tensor(f"blk.{i}.attn_k.weight", (kv * dh, d))
        tensor(f"blk.{i}.attn_v.weight", (kv * dh, d))
        tensor(f"blk.{i}.attn_output.weight", (d, heads * dh))
        tensor(f"blk.{i}.ffn_gate.weight", (ff, d))
        tensor(f"blk.{i}.ffn_up.weight", (ff, d))
        tensor(f"blk.{i}.ffn_down.weight", (d, ff))
    tensor("output_norm.weight", (d,))
    tensor("output.weight", (vocab, d))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def word_level_tokenizer(folder: Path, vocab_size: int, bos_id: int | None = None, auto_map: dict | None = None):
    """A word-level fast tokenizer saved into ``folder`` (BOS ``<s>`` prepended when ``bos_id`` is given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<unk>"] = vocab_size - 1
    if bos_id is not None:
        vocab["<s>"] = bos_id
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = {}
    if bos_id is not None:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos_id)])
        extra["bos_token"] = "<s>"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **extra).save_pretrained(folder)
    if auto_map is not None:
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["auto_map"] = auto_map
        config_file.write_text(json.dumps(config))


REMOTE_TOKENIZER = """\
from pathlib import Path
Path({marker!r}).write_text("imported")
from transformers import PreTrainedTokenizerFast


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


def remote_tokenizer_folder(folder: Path, marker: Path) -> Path:
    tiny_llama(folder)
    word_level_tokenizer(folder, 128, auto_map={"AutoTokenizer": [None, "custom_tok.CustomTokenizer"]})
    (folder / "custom_tok.py").write_text(REMOTE_TOKENIZER.format(marker=str(marker)))
    return folder


def unwritable_folder(tmp: Path) -> Path:
    """A folder path no one here can create: a read-only folder, or under /sys when running as root."""
    if os.geteuid() == 0:
        return Path("/sys/pytest-circuits-test-cache")
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return locked / "cache"


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def staging_folders(cache: Path) -> list[Path]:
    folder = cache / "gguf"
    return sorted(p for p in folder.iterdir() if p.name.startswith(".")) if folder.is_dir() else []


def converted_entry(cache: Path) -> Path:
    entries = [p for p in (cache / "gguf").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1, entries
    return entries[0]


# ---------------------------------------------------------------- the table


@dataclass
class Setup:
    argv: list[str]
    cache: Path
    check: object = None  # callable run after the CLI, with the Setup
    env: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    id: str
    make: object  # (tmp_path) -> Setup
    rc: int
    names: tuple[str, ...]  # substrings of the one stderr line


def _scan(model, tmp: Path, *extra, json_file=True) -> list[str]:
    argv = ["scan", str(model), *FAST, *extra]
    if json_file:
        good = tmp / "good.json"
        good.write_bytes(GOOD_JSON)
        argv += ["--json", str(good)]
    return argv


def case_pickle_in_index(tmp):
    folder = tiny_llama(tmp / "model")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    names = list(load_file(folder / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["lm_head.weight"] = "pytorch_model.bin"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    marker = tmp / "unpickled"
    write_marker_pickle(folder / "pytorch_model.bin", marker)
    return Setup(_scan(folder, tmp), tmp / "cache", check=lambda s: not marker.exists())


def case_config_names_bin(tmp):
    folder = tiny_llama(tmp / "model")
    config = json.loads((folder / "config.json").read_text())
    config["transformers_weights"] = "adapter_model.bin"
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp / "unpickled"
    write_marker_pickle(folder / "adapter_model.bin", marker)
    return Setup(_scan(folder, tmp), tmp / "cache", check=lambda s: not marker.exists())


def case_index_outside(tmp):
    folder = tiny_llama(tmp / "model")
    (folder / "model.safetensors").rename(tmp / "elsewhere.safetensors")
    weight_map = {n: "../elsewhere.safetensors" for n in load_file(tmp / "elsewhere.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return Setup(_scan(folder, tmp), tmp / "cache")


def case_pickle_named_safetensors(tmp):
    folder = tiny_llama(tmp / "model")
    marker = tmp / "unpickled"
    write_marker_pickle(folder / "model.safetensors", marker)
    return Setup(_scan(folder, tmp), tmp / "cache", check=lambda s: not marker.exists())


def case_pickle_only(tmp):
    folder = tiny_llama(tmp / "model")
    (folder / "model.safetensors").unlink()
    marker = tmp / "unpickled"
    write_marker_pickle(folder / "pytorch_model.bin", marker)
    return Setup(_scan(folder, tmp), tmp / "cache", check=lambda s: not marker.exists())


def case_nan_weights(tmp):
    folder = tiny_llama(tmp / "model")
    edit_weights(folder, set_values("model.layers.1.self_attn.o_proj.weight", float("nan"), 12))
    return Setup(_scan(folder, tmp), tmp / "cache")


def case_inf_weights(tmp):
    folder = tiny_llama(tmp / "model")
    edit_weights(folder, set_values("model.layers.0.mlp.down_proj.weight", float("-inf"), 3))
    return Setup(_scan(folder, tmp), tmp / "cache")


def case_fp16_overflow(tmp):
    folder = tiny_llama(tmp / "model")
    edit_weights(folder, set_values("model.layers.0.self_attn.v_proj.weight", 1e6, 2))  # > 65504
    return Setup(_scan(folder, tmp, "--build", "fp16"), tmp / "cache")


def case_vocab_one(tmp):
    folder = tiny_llama(tmp / "model", vocab_size=1)
    return Setup(_scan(folder, tmp), tmp / "cache")


def case_probe_n_huge(tmp):
    folder = tiny_llama(tmp / "model")
    argv = _scan(folder, tmp)
    argv[argv.index("--probe-n") + 1] = "1000000000"
    return Setup(argv, tmp / "cache")


def case_tokenizer_remote_code(tmp):
    marker = tmp / "imported"
    folder = remote_tokenizer_folder(tmp / "model", marker)
    return Setup(
        _scan(folder, tmp),
        tmp / "cache",
        check=lambda s: not marker.exists(),
        env={"HF_MODULES_CACHE": str(tmp / "modules")},
    )


def case_tokenizer_remote_code_trusted(tmp):
    marker = tmp / "imported"
    folder = remote_tokenizer_folder(tmp / "model", marker)
    return Setup(
        _scan(folder, tmp, "--trust-remote-code", json_file=False),
        tmp / "cache",
        check=lambda s: marker.read_text() == "imported",
        env={"HF_MODULES_CACHE": str(tmp / "modules")},
    )


def case_tokenizer_bos_outside(tmp):
    folder = tiny_llama(tmp / "model")
    word_level_tokenizer(folder, 128, bos_id=200)
    return Setup(_scan(folder, tmp), tmp / "cache")


def case_gguf_unsupported_type(tmp):
    return Setup(_scan(write_tiny_gguf(tmp / "q8k.gguf", q_type="Q8_K"), tmp), tmp / "cache")


def case_gguf_truncated_file(tmp):
    path = write_tiny_gguf(tmp / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return Setup(_scan(path, tmp), tmp / "cache")


def _cache_used(s: Setup) -> bool:
    return cache_entry_problem(converted_entry(s.cache)) is None and not staging_folders(s.cache)


def case_gguf_cache_is_file(tmp):
    cache = tmp / "cache-file"
    cache.write_text("not a folder")
    setup = Setup(_scan(write_tiny_gguf(tmp / "tiny.gguf"), tmp, json_file=False), cache)
    setup.check = lambda s: cache.read_text() == "not a folder"
    return setup


def case_gguf_cache_unwritable(tmp):
    cache = unwritable_folder(tmp)
    return Setup(
        _scan(write_tiny_gguf(tmp / "tiny.gguf"), tmp, json_file=False), cache, check=lambda s: not s.cache.exists()
    )


def case_gguf_cache_entry(spoil):
    """A converted cache entry that ``spoil(entry folder)`` damaged before the run: warned about, rebuilt."""

    def make(tmp):
        from pytest_circuits.model.loading import gguf_to_folder

        gguf_file = write_tiny_gguf(tmp / "tiny.gguf")
        cache = tmp / "cache"

        def prepare():
            os.environ["PYTEST_CIRCUITS_CACHE"] = str(cache)
            spoil(gguf_to_folder(gguf_file))

        setup = Setup(_scan(gguf_file, tmp, json_file=False), cache, check=_cache_used)
        setup.notes["prepare"] = prepare
        return setup

    return make


def truncate_weights(entry: Path) -> None:
    weights = entry / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])


def case_gguf_stale_staging(tmp):
    """What kill -9 during a conversion leaves (a staging folder of a dead owner) is removed on the next run;
    a live owner's staging folder and a fresh owner-less one stay."""
    cache = tmp / "cache"
    root = cache / "gguf"
    root.mkdir(parents=True)
    dead = root / ".staging-0123456789abcdef.dead"
    dead.mkdir()
    (dead / "OWNER.json").write_text(json.dumps({"pid": dead_pid(), "host": os.uname().nodename, "started": 0}))
    (dead / "model.safetensors").write_bytes(b"\0" * 4096)
    live = root / ".staging-0123456789abcdef.live"
    live.mkdir()
    (live / "OWNER.json").write_text(json.dumps({"pid": 1, "host": os.uname().nodename, "started": time.time()}))

    def check(s):
        left = staging_folders(cache)
        return left == [live] and cache_entry_problem(converted_entry(cache)) is None

    return Setup(_scan(write_tiny_gguf(tmp / "tiny.gguf"), tmp, json_file=False), cache, check=check)


def case_gguf_cache_full(tmp):
    """Writes beyond 40 KB fail (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC) in the cache and in the
    temporary fallback: one line naming both, nothing left behind."""
    cache = tmp / "cache"
    setup = Setup(
        _scan(write_tiny_gguf(tmp / "tiny.gguf", seed=7), tmp),
        cache,  # a key no other row converted
        check=lambda s: not staging_folders(cache) and not any((cache / "gguf").iterdir()),
    )
    setup.notes["fsize"] = 40_000
    return setup


# issue 27: JSON the parser refuses past JSONDecodeError (T1), config errors other than ValueError (T3),
# no layers (T4)
DEEP = "[" * 2000 + "]" * 2000  # RecursionError in json.loads
LONG_INT = "7" * 5000  # ValueError: Exceeds the limit (4300 digits)


def edit_json(file: Path, key: str, raw: str) -> None:
    """Set ``key`` of the JSON object in ``file`` to the raw JSON text ``raw``."""
    data = json.loads(file.read_text())
    data[key] = "@RAW@"
    file.write_text(json.dumps(data).replace('"@RAW@"', raw))


def case_config_json(key: str, raw: str):
    def make(tmp):
        folder = tiny_llama(tmp / "model")
        edit_json(folder / "config.json", key, raw)
        return Setup(_scan(folder, tmp), tmp / "cache")

    return make


def case_index_deep(tmp):
    folder = tiny_llama(tmp / "model")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text('{"metadata": ' + DEEP + ', "weight_map": {}}')
    return Setup(_scan(folder, tmp), tmp / "cache")


def case_tokenizer_config_deep(tmp):
    folder = tiny_llama(tmp / "model")
    word_level_tokenizer(folder, 128)
    edit_json(folder / "tokenizer_config.json", "extra", DEEP)
    return Setup(_scan(folder, tmp), tmp / "cache")


CASES = [
    Case(
        "index-names-pytorch_model.bin",
        case_pickle_in_index,
        2,
        ("non-safetensors weight file 'pytorch_model.bin'", "model.safetensors.index.json"),
    ),
    Case(
        "config-names-adapter_model.bin", case_config_names_bin, 2, ("non-safetensors weight file 'adapter_model.bin'",)
    ),
    Case(
        "index-names-file-outside-folder", case_index_outside, 2, ("'../elsewhere.safetensors'", "outside the folder")
    ),
    Case(
        "pickle-bytes-in-model.safetensors", case_pickle_named_safetensors, 2, ("model.safetensors", "cannot be read")
    ),
    Case("pickle-only-folder", case_pickle_only, 2, ("only pickle weights", "pytorch_model.bin")),
    Case("nan-weights", case_nan_weights, 2, ("model.layers.1.self_attn.o_proj.weight holds 12 NaN values",)),
    Case("inf-weights", case_inf_weights, 2, ("model.layers.0.mlp.down_proj.weight holds 3 inf values",)),
    Case(
        "fp16-cast-overflows",
        case_fp16_overflow,
        2,
        ("build fp16", "model.layers.0.self_attn.v_proj.weight holds 2 inf values", "bf16"),
    ),
    Case("vocab-size-1", case_vocab_one, 2, ("1 ordinary token id", "vocab_size 1")),
    Case("probe-n-1e9", case_probe_n_huge, 2, ("--probe-n", "1000000000")),
    Case(
        "tokenizer-remote-code-refused",
        case_tokenizer_remote_code,
        2,
        ("tokenizer_config.json has auto_map", "--trust-remote-code"),
    ),
    Case("tokenizer-remote-code-trusted", case_tokenizer_remote_code_trusted, 0, ()),
    Case("tokenizer-bos-outside-vocab", case_tokenizer_bos_outside, 2, ("BOS id 200", "vocab_size 128")),
    Case("gguf-unsupported-tensor-type", case_gguf_unsupported_type, 2, ("blk.0.attn_q.weight", "type Q8_K")),
    Case("gguf-truncated-file", case_gguf_truncated_file, 2, ("tiny.gguf", "damaged or truncated")),
    Case("gguf-cache-path-is-a-file", case_gguf_cache_is_file, 0, ("warning", "cache-file", "temporary folder")),
    Case(
        "gguf-cache-unwritable",
        case_gguf_cache_unwritable,
        0,
        ("warning", "pytest-circuits-test-cache" if os.geteuid() == 0 else "locked"),
    ),
    Case(
        "gguf-cache-entry-truncated",
        case_gguf_cache_entry(truncate_weights),
        0,
        ("warning", "model.safetensors has", "rebuilding"),
    ),
    Case("gguf-stale-staging-of-dead-owner", case_gguf_stale_staging, 0, ()),
    Case("gguf-cache-full", case_gguf_cache_full, 2, ("tiny.gguf", "temporary folder failed too", "free space")),
    Case("config.json-2000-levels", case_config_json("x", DEEP), 2, ("config.json nests deeper than 64 levels",)),
    Case("config.json-5000-digits", case_config_json("x", LONG_INT), 2, ("config.json holds a value", "4300 digits")),
    Case("index-2000-levels", case_index_deep, 2, ("model.safetensors.index.json nests deeper than 64 levels",)),
    Case("tokenizer_config-2000-levels", case_tokenizer_config_deep, 2, ("tokenizer_config.json nests deeper",)),
    Case(
        "gguf-marker-2000-levels",
        case_gguf_cache_entry(lambda entry: edit_json(entry / MARKER, "files", DEEP)),
        0,
        ("warning", "COMPLETE.json nests deeper", "rebuilding"),
    ),
    Case(
        "config-hidden_size-string",
        case_config_json("hidden_size", '"64"'),
        2,
        ("transformers refuses its config.json (StrictDataclassFieldValidationError", "'hidden_size' expected int"),
    ),
    Case("config-vocab_size-float", case_config_json("vocab_size", "128.5"), 2, ("'vocab_size' expected int",)),
    Case(
        "config-hidden_size-not-a-multiple-of-heads",
        case_config_json("hidden_size", "30"),
        2,
        ("StrictDataclassClassValidationError", "not a multiple of the number of attention heads"),
    ),
    Case("config-zero-heads", case_config_json("num_attention_heads", "0"), 2, ("ZeroDivisionError", "config.json")),
    Case("config-zero-layers", case_config_json("num_hidden_layers", "0"), 2, ("n_layers 0", "at least 1")),
    Case("config-negative-layers", case_config_json("num_hidden_layers", "-2"), 2, ("n_layers -2", "at least 1")),
]


# ---------------------------------------------------------------- runners


def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return apply


def run_in_process(setup: Setup, monkeypatch, capsys) -> tuple[int, str, str]:
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setenv("PYTEST_CIRCUITS_CACHE", str(setup.cache))
    if "HF_MODULES_CACHE" in setup.env:
        monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", setup.env["HF_MODULES_CACHE"])
    capsys.readouterr()
    limit = setup.notes.get("fsize")
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.getsignal(signal.SIGXFSZ)
    try:
        if limit:
            _limit_file_size(limit)()
        rc = cli.main(setup.argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)
    out, err = capsys.readouterr()
    return rc, out, err


def cli_env(cache: Path, extra: dict | None = None) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "PYTEST_CIRCUITS_CACHE": str(cache),
        **(extra or {}),
    }


def run_subprocess(setup: Setup) -> tuple[int, str, str]:
    limit = setup.notes.get("fsize")
    done = subprocess.run(
        [sys.executable, "-m", "pytest_circuits.cli", *setup.argv],
        env=cli_env(setup.cache, setup.env),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=setup.cache.parent,
        preexec_fn=_limit_file_size(limit) if limit else None,
    )
    return done.returncode, done.stdout, done.stderr


def check_outcome(case: Case, setup: Setup, rc: int, out: str, err: str, tmp: Path) -> None:
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == case.rc, f"rc {rc}: {err}"
    if case.names:
        assert len(lines) == 1, lines
        for name in case.names:
            assert name in lines[0], lines[0]
        if case.rc == 2:
            assert lines[0].startswith("circuits scan: "), lines[0]
    else:
        assert lines == [], lines
    if (tmp / "good.json").exists():
        assert (tmp / "good.json").read_bytes() == GOOD_JSON
    if setup.check is not None:
        assert setup.check(setup), f"{case.id}: after-check failed"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_in_process(case, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTEST_CIRCUITS_CACHE", str(tmp_path / "cache"))
    setup = case.make(tmp_path)
    if "prepare" in setup.notes:
        setup.notes["prepare"]()
    rc, out, err = run_in_process(setup, monkeypatch, capsys)
    check_outcome(case, setup, rc, out, err, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_cli_subprocess(case, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_CIRCUITS_CACHE", str(tmp_path / "cache"))
    setup = case.make(tmp_path)
    if "prepare" in setup.notes:
        setup.notes["prepare"]()
    rc, out, err = run_subprocess(setup)
    check_outcome(case, setup, rc, out, err, tmp_path)


SLOW_SAVE = """\
import sys, time
from pytest_circuits import cli
from pytest_circuits.model import gguf_cache

original = gguf_cache._Converter.save


def save_then_hang(self, staging):
    original(self, staging)
    (staging / "SAVED").write_text("")
    time.sleep(600)


gguf_cache._Converter.save = save_then_hang
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_9_during_gguf_conversion_leaves_no_staging(tmp_path):
    """kill -9 while the converted weights sit in the staging folder; the next run removes it and converts."""
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    argv = ["scan", str(gguf_file), *FAST]
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_SAVE, *argv], env=cli_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 300
        while not any((p / "SAVED").exists() for p in staging_folders(cache)):
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the conversion never reached its staging folder"
            time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    left = staging_folders(cache)
    assert len(left) == 1 and (left[0] / "model.safetensors").stat().st_size > 0  # what the kill left
    done = subprocess.run(
        [sys.executable, "-m", "pytest_circuits.cli", *argv],
        env=cli_env(cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert staging_folders(cache) == []
    assert cache_entry_problem(converted_entry(cache)) is None
    assert (converted_entry(cache) / MARKER).is_file()


# ---------------------------------------------------------------- fsio: the write layer itself


def _one_line_error(call) -> str:
    from pytest_circuits.errors import FileSystemError

    with pytest.raises(FileSystemError) as error:
        call()
    text = str(error.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_atomic_write_replaces_whole_files(tmp_path):
    from pytest_circuits.fsio import atomic_write_text

    target = tmp_path / "sub" / "scan.json"
    atomic_write_text(target, "first\n")
    atomic_write_text(target, "second\n")
    assert target.read_text() == "second\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["scan.json"]  # no temporary file left


def test_atomic_write_on_a_full_disk_keeps_the_old_file(tmp_path):
    """A real write failure (RLIMIT_FSIZE: EFBIG, as ENOSPC on a full disk): one line, old bytes, no temp."""
    from pytest_circuits.fsio import atomic_write_text

    target = tmp_path / "baseline.json"
    target.write_bytes(GOOD_JSON)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.getsignal(signal.SIGXFSZ)
    try:
        _limit_file_size(10_000)()
        line = _one_line_error(lambda: atomic_write_text(target, "x" * 100_000))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert str(target) in line and "no space" in line
    assert target.read_bytes() == GOOD_JSON
    assert sorted(p.name for p in tmp_path.iterdir()) == ["baseline.json"]


def test_filesystem_faults_are_one_line(tmp_path):
    from pytest_circuits.fsio import atomic_write_text, ensure_dir

    a_file = tmp_path / "a-file"
    a_file.write_text("in the way")
    line = _one_line_error(lambda: ensure_dir(a_file))
    assert str(a_file) in line and "it is a file" in line
    line = _one_line_error(lambda: atomic_write_text(a_file / "scan.json", "{}"))
    assert str(a_file) in line and "file" in line
    line = _one_line_error(lambda: atomic_write_text(tmp_path, "{}"))
    assert "is a folder" in line
    locked = unwritable_folder(tmp_path)
    line = _one_line_error(lambda: atomic_write_text(locked / "scan.json", "{}"))
    assert str(locked) in line and ("permission" in line or "read-only" in line)
    assert a_file.read_text() == "in the way"


def test_stale_temps_and_staging_are_removed(tmp_path):
    from pytest_circuits.fsio import make_staging_dir, remove_stale_staging, remove_stale_temps

    old_temp = tmp_path / ".baseline.json.abc123.tmp"
    old_temp.write_text("half")
    os.utime(old_temp, (time.time() - 3600, time.time() - 3600))
    fresh_temp = tmp_path / ".baseline.json.def456.tmp"
    fresh_temp.write_text("being written")
    other = tmp_path / "baseline.json"
    other.write_text("{}")
    assert remove_stale_temps(tmp_path, older_than_s=600) == [old_temp]
    assert fresh_temp.exists() and other.exists()

    mine = make_staging_dir(tmp_path, ".staging-x.")  # owned by this live process
    dead = tmp_path / ".staging-y.dead"
    dead.mkdir()
    (dead / "OWNER.json").write_text(json.dumps({"pid": dead_pid(), "host": os.uname().nodename, "started": 0}))
    orphan = tmp_path / ".staging-z.orphan"  # no owner recorded: stale only when old
    orphan.mkdir()
    assert remove_stale_staging(tmp_path, ".staging-", max_age_s=600) == [dead]
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    assert remove_stale_staging(tmp_path, ".staging-", max_age_s=600) == [orphan]
    assert mine.is_dir()


def test_a_link_is_never_written_through(tmp_path):
    """Issue 38: a link planted where a file is written (git stores links) wrote the record into the
    file it named, anywhere. A link, dangling or not, to a file or a folder, is refused in one line
    naming it and the fix; the file it names and the link stay as they were, no temporary file left."""
    from pytest_circuits.fsio import atomic_write_text

    victim = tmp_path / "victim.txt"
    victim.write_text("VICTIM\n")
    folder = tmp_path / "baselines"
    folder.mkdir()
    for name, target in (("file.json", victim), ("dangling.json", tmp_path / "new.txt"), ("dir.json", tmp_path)):
        link = folder / name
        link.symlink_to(target)
        line = _one_line_error(lambda link=link: atomic_write_text(link, "{}"))
        assert f"cannot write {link}: it is a symbolic link (to {target})" in line and "remove the link" in line
        assert link.is_symlink() and os.readlink(link) == str(target)
    assert victim.read_text() == "VICTIM\n" and not (tmp_path / "new.txt").exists()
    assert sorted(p.name for p in folder.iterdir()) == ["dangling.json", "dir.json", "file.json"]


def test_dev_stdout_is_still_written_through():
    """The system's own stream links (``--json /dev/stdout``, issue 27) are the one exception."""
    code = "from pytest_circuits.fsio import atomic_write_text; atomic_write_text('/dev/stdout', 'to the pipe\\n')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "to the pipe\n", done.stderr


def test_devices_are_written_through_not_replaced(tmp_path):
    """A character device (a copy of /dev/null made here) is written through and stays what it was
    (issue 27: `--json /dev/stdout`; a link to one outside /dev is refused: issue 38)."""
    import stat

    from pytest_circuits.fsio import atomic_write_text

    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD); the FIFO row of test_bad_baselines covers non-regular files")
    atomic_write_text(node, "into the void\n")
    assert stat.S_ISCHR(os.lstat(node).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]
