"""The calibrated 4-bit recipes ``gptq-int4`` and ``awq-int4``, made by llm-compressor.

llm-compressor is the library that writes the GPTQ and AWQ checkpoints vLLM serves (in the
compressed-tensors format, `compressed`), so the build gated is the build shipped. It pins
transformers <= 5.17 and compressed-tensors 0.19 and cannot share this environment (gptqmodel
would replace torch; torchao's GPTQ needs CUDA-only int4 kernels), so it runs out of process:
``$PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON`` names the Python of an environment that has it
(``pip install torch==2.13.0 llmcompressor==0.14.0``), `llmc_worker` runs GPTQ or AWQ there on
the float32 checkpoint and writes a compressed-tensors checkpoint into the cache, and the build
loads that checkpoint like any other (its own decompressor, its reference forward).

Scheme: int4 weights, symmetric, one scale per group of ``group_size`` input columns (128, or
``-g<N>``: ``gptq-int4-g64``), every ``Linear`` but ``lm_head``; the same grid as ``W4A16``.

Calibration data, made here without a download: ordinary English text when the model has a
tokenizer (the docstrings of `CALIBRATION_MODULES` of the running Python's standard library:
technical prose, never the probe's random repeated tokens, which would tune the quantizer to the
very circuit the gate measures); a model without a tokenizer gets seeded uniform token ids
(no repeats planted). `HELD_OUT_MODULES` give held-out text for the quality check in the docs.
The build's identity records what was used and its sha256.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..errors import RecipeError, first_line
from .loading import ModelSource, cache_root, weight_fingerprint

LLMC_PYTHON = "PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON"
LLMC_INSTALL = "pip install torch==2.13.0 llmcompressor==0.14.0"
N_SEQUENCES = 32
SEQUENCE_LENGTH = 256
CALIBRATION_MODULES = (
    "argparse",
    "collections",
    "configparser",
    "csv",
    "doctest",
    "email.message",
    "functools",
    "json",
    "logging",
    "pathlib",
    "typing",
    "unittest.case",
)
HELD_OUT_MODULES = ("decimal", "fractions", "heapq", "inspect", "shutil", "statistics", "subprocess", "tarfile")


def stdlib_text(modules: tuple[str, ...]) -> str:
    """The docstrings of ``modules`` and of their public members, in name order, joined."""
    import importlib
    import inspect
    import warnings

    parts: list[str] = []
    with warnings.catch_warnings():  # reading typing.io's docstring warns that it is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in modules:
            module = importlib.import_module(name)
            parts.append(inspect.getdoc(module) or "")
            for member, value in sorted(vars(module).items()):
                if member.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                    continue
                parts.append(inspect.getdoc(value) or "")
    return "\n\n".join(p for p in parts if p)


def text_ids(folder: Path, modules: tuple[str, ...], n: int, length: int) -> torch.Tensor | None:
    """``(n', length)`` token ids of ``modules``' docstrings (``n' <= n``); None without a tokenizer."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError):
        return None
    ids = tokenizer(stdlib_text(modules), return_tensors="pt").input_ids[0]
    rows = min(n, ids.numel() // length)
    return ids[: rows * length].reshape(rows, length)


def calibration_ids(source: ModelSource, config) -> tuple[torch.Tensor, str]:
    """The calibration token ids of ``source`` and a line saying what they are."""
    length = min(SEQUENCE_LENGTH, int(getattr(config, "max_position_embeddings", SEQUENCE_LENGTH)))
    ids = text_ids(source.folder, CALIBRATION_MODULES, N_SEQUENCES, length)
    if ids is not None:
        what = f"Python {sys.version.split()[0]} standard-library docstrings ({', '.join(CALIBRATION_MODULES)})"
    else:
        generator = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, int(config.vocab_size), (N_SEQUENCES, length), generator=generator)
        what = "seeded uniform token ids (seed 1234; the model has no tokenizer)"
    digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:12]
    return ids, f"{ids.shape[0]} x {ids.shape[1]} tokens of {what}, sha256 {digest}"


def llmc_python(recipe_name: str) -> str:
    """The Python that has llm-compressor, or a one-line error saying how to make one."""
    python = os.environ.get(LLMC_PYTHON)
    if not python:
        raise RecipeError(
            f"recipe {recipe_name} runs llm-compressor, which pins transformers<=5.17 and cannot share this "
            f"environment: make a venv with `{LLMC_INSTALL}` and set {LLMC_PYTHON}=/path/to/that/venv/bin/python"
        )
    if not Path(python).is_file():
        raise RecipeError(f"recipe {recipe_name}: {LLMC_PYTHON}={python} does not exist; point it at a python")
    return python


@functools.cache  # asked before any work (`requirements`) and again where the build is made
def llmc_version(python: str) -> str:
    """``llmcompressor 0.14.0.1`` as installed in ``python``'s environment."""
    code = "import importlib.metadata as m; print(m.version('llmcompressor'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RecipeError(f"{LLMC_PYTHON}={python} has no llmcompressor: {LLMC_INSTALL} in that environment")
    return f"llmcompressor {done.stdout.strip()}"


def calibrated_checkpoint(source: ModelSource, config, method: str, group_size: int, name: str) -> tuple[Path, str]:
    """The compressed-tensors checkpoint llm-compressor's ``method`` makes of ``source`` (made
    once, then read from the cache) and the line describing its calibration data."""
    python = llmc_python(name)
    version = llmc_version(python)
    ids, calibration = calibration_ids(source, config)
    key = json.dumps([weight_fingerprint(source.folder), method, group_size, calibration, version])
    folder = cache_root() / "calibrated" / hashlib.sha256(key.encode()).hexdigest()
    if (folder / "COMPLETE.json").is_file():
        return folder, calibration
    from safetensors.torch import save_file

    staging = folder.with_name(folder.name + f".partial-{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": ids.contiguous()}, str(staging / "calibration.safetensors"))
    worker = Path(__file__).with_name("llmc_worker.py")
    args = [python, str(worker), method, str(source.folder), str(staging), str(staging / "calibration.safetensors")]
    done = subprocess.run([*args, str(group_size)], capture_output=True, text=True)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no message"]
        raise RecipeError(f"recipe {name}: llm-compressor failed on {source.name}: {first_line(Exception(last[0]))}")
    (staging / "calibration.safetensors").unlink()
    (staging / "COMPLETE.json").write_text(json.dumps({"key": key}))
    staging.rename(folder)
    return folder, calibration
