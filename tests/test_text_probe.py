"""The own-text probe (``--circuits-probe-text`` / ``--probe-text``): the repeat probe's shape on a team's
own text. Its copy loss against a plain loop of forwards over ids computed here, its seeded passages,
a broken induction head failing copy_loss on it, a baseline of another probe refused, and bad input
one line each, from both front ends."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from pytest_circuits.cli import main
from pytest_circuits.rungs.repeat_settings import ProbeTextError, RepeatSettings, read_probe_text
from pytest_circuits.testing import requires_embedded_model

pytestmark = requires_embedded_model()
SMALL = ["--device", "cpu", "--probe-n", "4", "--probe-length", "16"]
SYLLABLES = ("ka", "lo", "mi", "ren", "tos", "vel", "dra", "qui", "sun", "mar", "pel", "zor", "bri", "fen", "gal")


def own_words(count: int, salt: int = 0) -> list[str]:
    """``count`` made-up words of a small vocabulary (80 words), as a team's text repeats its terms."""
    vocab = [SYLLABLES[i % 15] + SYLLABLES[(i * 7 + salt) % 15] + SYLLABLES[(i * 11) % 13] for i in range(80)]
    return [vocab[(i * 37 + i * i * 3 + salt) % 80] for i in range(count)]


def write_text(path, count: int = 600, salt: int = 0):
    words = own_words(count, salt)
    path.write_text("\n".join(" ".join(words[i : i + 12]) + "." for i in range(0, count, 12)) + "\n")
    return path


def word_ids(text: str) -> list[int]:
    """The embedded model's reading of text, computed here (docs/audit.md): sha256's first 8 bytes mod 512."""
    return [int(hashlib.sha256(w.encode()).hexdigest()[:16], 16) % 512 for w in text.split()]


def expected_passages(text: str, n: int, L: int, seed: int) -> np.ndarray:
    """docs/definitions.md, "The own-text probe": n of the floor(T/L) consecutive passages, drawn with the seed."""
    stream = word_ids(text)
    chosen = np.random.Generator(np.random.PCG64(seed)).choice(len(stream) // L, size=n, replace=False)
    return np.array([stream[i * L : (i + 1) * L] for i in chosen])


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    return write_text(tmp_path_factory.mktemp("own") / "own.txt")


@pytest.fixture(scope="module")
def run(own):
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    probe = RepeatSettings(seed=0, n=4, L=16, text=read_probe_text(own))
    return Run(CircuitsSettings(builds=("fp32",), device="cpu", probe=probe))


def test_copy_loss_equals_a_plain_loop_of_forwards_over_the_passages(run, own):
    from pytest_circuits.rungs.probe import run_repeat_probe
    from pytest_circuits.rungs.text_probe import probe_ids

    build, settings = run.loaded.build("fp32"), run.loaded.settings.probe
    L = settings.L
    passages = expected_passages(own.read_text(), settings.n, L, settings.seed)
    ids = probe_ids(build.source, build.tokens, settings)
    assert build.tokens.bos_id is None and ids.tolist() == np.concatenate([passages, passages], axis=1).tolist()
    copies, firsts = [], []
    for passage in passages:
        sequence = torch.tensor([list(passage) * 2])
        with torch.no_grad():
            logp = torch.log_softmax(build.model(input_ids=sequence).logits[0].double(), dim=-1)
        ce = [-float(logp[t - 1, sequence[0, t]]) for t in range(2 * L)]
        copies.append(np.mean(ce[L + 1 : 2 * L]))
        firsts.append(np.mean(ce[1:L]))
    got = run_repeat_probe(build, settings)
    assert got.copy_loss == pytest.approx(np.mean(copies), abs=1e-4)
    assert got.first_copy_loss == pytest.approx(np.mean(firsts), abs=1e-4)
    assert got.copy_loss < 1.0 < got.first_copy_loss  # the induction head copies the repeat of in-domain text too


def test_the_seeded_passages_are_the_same_on_every_rerun_and_differ_by_seed(own):
    from pytest_circuits.model.named import named_model_path
    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.text_probe import probe_ids, text_stream
    from pytest_circuits.settings import CircuitsSettings

    assert named_model_path("tiny-induction") is not None
    settings = CircuitsSettings(builds=("fp32",), device="cpu")
    loaded = Run(settings).loaded
    loaded.preflight()
    source, tokens = loaded.source, loaded.build("fp32").tokens

    def drawn(seed: int) -> list:
        text_stream.cache_clear()  # read and tokenized again, as a new run does
        return probe_ids(source, tokens, RepeatSettings(seed=seed, n=4, L=16, text=read_probe_text(own))).tolist()

    assert drawn(0) == drawn(0) == np.tile(expected_passages(own.read_text(), 4, 16, 0), 2).tolist()
    assert drawn(1) != drawn(0)  # the knockouts' held-out seed draws other passages (or another order)


def test_a_tokenizer_reads_the_text_with_no_special_token_and_bos_first(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.vocab import token_info
    from pytest_circuits.rungs.text_probe import probe_ids, text_identity
    from pytest_circuits.testing import save_tiny_model

    folder = save_tiny_model("llama", tmp_path / "m")
    words = ["[UNK]", "[BOS]", "red", "fox", "jumps", "blue", "owl", "sleeps"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="[BOS]").save_pretrained(folder)
    text = tmp_path / "t.txt"
    text.write_text("red fox jumps blue owl sleeps")  # 6 tokens: three passages of 2
    from transformers import AutoConfig

    source = resolve_model(str(folder))
    tokens = token_info(folder, AutoConfig.from_pretrained(folder), False)
    settings = RepeatSettings(seed=5, n=3, L=2, text=read_probe_text(text))
    ids = probe_ids(source, tokens, settings).tolist()
    passages = [[2, 3], [4, 5], [6, 7]]
    order = np.random.Generator(np.random.PCG64(5)).choice(3, size=3, replace=False)
    assert ids == [[1, *passages[i], *passages[i]] for i in order]
    identity = text_identity(source, tokens, settings)["text"]
    assert identity["tokens"] == "tokenizer" and identity["sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, own):
    """tiny-induction's fp32 baseline recorded on the own-text probe."""
    folder = tmp_path_factory.mktemp("own-baselines")
    argv = ["record", "tiny-induction", "--build", "fp32", "--baselines", str(folder), "--probe-text", str(own)]
    assert main([*argv, *SMALL]) == 0
    return folder


def test_the_record_names_the_text_and_the_ids(baselines, own):
    record = json.loads((baselines / "tiny-induction--fp32.json").read_text())
    text = record["probe"]["text"]
    assert text["file"] == "own.txt" and text["sha256"] == hashlib.sha256(own.read_bytes()).hexdigest()
    assert text["tokens"] == "words"
    ids = np.tile(expected_passages(own.read_text(), 4, 16, 0), 2).astype("<i8")
    assert text["ids_sha256"] == hashlib.sha256(ids.tobytes()).hexdigest()
    assert record["knockout"]["text"]["sha256"] == text["sha256"]  # the knockouts' held-out passages: same file
    assert record["knockout"]["text"]["ids_sha256"] != text["ids_sha256"]
    from pytest_circuits.record.schema import Record
    from pytest_circuits.show import model_lines

    assert any(line.startswith("probe seed 0 n 4 L 16 on own text own.txt:") for line in model_lines(Record.of(record)))


def test_gate_on_own_text_fails_a_broken_induction_head_and_passes_a_benign_build(baselines, broken, own, capsys):
    baseline = str(baselines / "tiny-induction--fp32.json")
    argv = ["gate", "tiny-induction", "--baseline", baseline, "--probe-text", str(own), "--no-knockout", *SMALL]
    assert main([*argv, "--build", f"broken={broken}"]) == 1
    out = capsys.readouterr().out
    assert "FAIL copy_loss" in out, out
    assert main([*argv, "--build", "rtn-int8"]) == 0
    out = capsys.readouterr().out
    assert "PASS copy_loss" in out and "gate passed" in out


def test_a_baseline_of_another_probe_is_refused_in_one_line(baselines, tmp_path, capsys):
    baseline = str(baselines / "tiny-induction--fp32.json")
    argv = ["gate", "tiny-induction", "--build", "fp32", "--baseline", baseline, *SMALL]
    assert main(argv) == 2  # the random-repeat probe against an own-text baseline
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was recorded on the own text own.txt (sha256" in err[0]
    assert "this run asks for the random-repeat probe; give --probe-text own.txt (that file)" in err[0]
    other = write_text(tmp_path / "other.txt", salt=3)
    assert main([*argv, "--probe-text", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this run asks for the own text other.txt" in err[0]
    from pytest_circuits.record.store import shipped_baselines

    shipped = str(shipped_baselines()["tiny-induction--fp32"])  # recorded on the random-repeat probe
    argv = ["gate", "tiny-induction", "--build", "fp32", "--baseline", shipped, "--probe-text", str(other)]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was recorded on the random-repeat probe" in err[0] and "drop --probe-text" in err[0]


def test_bad_text_is_one_line_before_any_weight_loads(tmp_path, capsys):
    from pytest_circuits.testing import save_tiny_model

    short = tmp_path / "short.txt"
    short.write_text(" ".join(own_words(50)))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    folder = save_tiny_model("llama", tmp_path / "m")
    capsys.readouterr()  # transformers' own progress bar of the save
    cases = [
        (tmp_path / "none.txt", f"{tmp_path / 'none.txt'}: no such file; give the path of a UTF-8 text file"),
        (empty, f"{empty} is empty; give a text with at least n x L tokens"),
        (
            short,
            f"{short}: 50 tokens, but n=4 passages of L=16 need 64; give a longer text or lower --probe-n or --probe-length",
        ),
    ]
    for path, said in cases:
        assert main(["scan", "tiny-induction", "--probe-text", str(path), *SMALL]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"circuits scan: --probe-text {said}"]
    assert main(["scan", str(folder), "--probe-text", str(short), *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model m has no tokenizer, and the own-text probe reads text" in err[0]
    with pytest.raises(ProbeTextError, match="the own-text probe runs on torch only"):
        from pytest_circuits.settings import build_settings

        build_settings({"probe-text": str(short), "engine": "llama.cpp"}, tmp_path, "cli")


def test_the_pytest_front_end_gates_on_own_text_and_refuses_bad_input(baselines, own, tmp_path):
    def suite(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "--pyargs", "pytest_circuits.probes", "-p", "no:cacheprovider", "-q"]
            + ["-k", "copy_loss", "--circuits-builds", "rtn-int8", "--circuits-baselines", str(baselines)]
            + ["--circuits-probe-n", "4", "--circuits-probe-length", "16", "--circuits-device", "cpu", *extra],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )

    done = suite("--circuits-probe-text", str(own))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout  # rtn-int8 against the fp32 baseline recorded on the own text
    refused = suite()  # an own-text baseline, the random-repeat probe asked for
    assert refused.returncode == 1 and "was recorded on the own text own.txt" in refused.stdout
    missing = suite("--circuits-probe-text", str(tmp_path / "none.txt"))
    assert missing.returncode == 4 and "--circuits-probe-text" in missing.stderr and "no such file" in missing.stderr
    assert "Traceback" not in missing.stderr + missing.stdout
