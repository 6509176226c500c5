#!/usr/bin/env python
"""Train the embedded default model ``tiny-induction``: 2 layers, 4 heads, d_model 128, RoPE.

Deterministic (seeded torch, numpy PCG64, one thread) and CPU-only: a few minutes here.
Each training sequence is 256 tokens of back-to-back segments ``[x, x]`` with ``x``
uniform over the 512 ids and ``len(x)`` uniform in 4..64; the loss is taken on the second
copies only (the first copies are unpredictable noise). A previous-token head forms in
layer 0 and induction heads in layer 1. The saved folder holds ``config.json`` and
``model.safetensors`` (no tokenizer: every id is ordinary) plus ``TRAINING.json``, with
the probe, kappa and knockout figures measured by the package's own code.

Reproduce the shipped model with the defaults:

    python scripts/train_tiny_induction.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "pytest_circuits" / "models" / "tiny-induction"
IGNORE = -100

HPARAMS = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "sequence_length": 256,
    "segment_length": [4, 64],
    "batch_size": 16,
    "lr": 1e-3,
    "weight_decay": 0.01,
    "grad_clip": 1.0,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: the shipped model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    return p.parse_args()


def model_config() -> LlamaConfig:
    """The architecture: a Llama-family model with no special tokens at all."""
    h = HPARAMS
    return LlamaConfig(
        vocab_size=h["vocab_size"],
        hidden_size=h["hidden_size"],
        intermediate_size=h["intermediate_size"],
        num_hidden_layers=h["num_hidden_layers"],
        num_attention_heads=h["num_attention_heads"],
        num_key_value_heads=h["num_attention_heads"],
        max_position_embeddings=h["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def training_batch(rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids ``(B, T)`` of back-to-back ``[x, x]`` segments, and labels on the second copies only."""
    h = HPARAMS
    low, high = h["segment_length"]
    T, V = h["sequence_length"], h["vocab_size"]
    ids = np.empty((h["batch_size"], T), dtype=np.int64)
    labels = np.empty_like(ids)
    for row in range(h["batch_size"]):
        parts, targets, filled = [], [], 0
        while filled < T:
            x = rng.integers(0, V, int(rng.integers(low, high + 1)))
            parts += [x, x]
            targets += [np.full(x.size, IGNORE), x]
            filled += 2 * x.size
        ids[row] = np.concatenate(parts)[:T]
        labels[row] = np.concatenate(targets)[:T]
    return torch.from_numpy(ids), torch.from_numpy(labels)


def train(seed: int, steps: int) -> LlamaForCausalLM:
    """AdamW on the masked next-token loss, constant learning rate, gradient clipping."""
    torch.manual_seed(seed)
    rng = np.random.Generator(np.random.PCG64(seed))
    model = LlamaForCausalLM(model_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=HPARAMS["lr"], weight_decay=HPARAMS["weight_decay"])
    start = time.time()
    for step in range(steps):
        ids, labels = training_batch(rng)
        loss = model(ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HPARAMS["grad_clip"])
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d}  copy loss {loss.item():.3f}  {time.time() - start:6.1f}s", flush=True)
    return model.eval()


def evaluate(folder: Path) -> dict:
    """The shipped figures, measured by the package itself (probe, kappa, knockouts)."""
    from pytest_circuits.builds import load_build
    from pytest_circuits.kappa import ov_spectrum
    from pytest_circuits.knockout import knockout_scan
    from pytest_circuits.loading import resolve_model
    from pytest_circuits.probe import run_repeat_probe
    from pytest_circuits.repeat import RepeatSettings
    from pytest_circuits.weights import extract_weights

    build = load_build(resolve_model(str(folder)), "fp32", "cpu")
    probe = run_repeat_probe(build, RepeatSettings(seed=0, n=64, L=64))
    knockout = knockout_scan(build, RepeatSettings(seed=1, n=64, L=64), progress=False)
    spectrum = ov_spectrum(extract_weights(build.model))
    heads = probe.heads.merge(knockout[["head", "knockout_delta"]], on="head")
    heads = heads.merge(spectrum[["head", "kappa", "kappa_trace", "copying"]], on="head")
    print(heads.to_string(index=False))
    return {
        "probe": {"seed": 0, "n": 64, "L": 64, **probe.model_figures()},
        "heads": heads.round(4).to_dict(orient="records"),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one thread: the same floats on every run
    torch.use_deterministic_algorithms(True)
    start = time.time()
    model = train(args.seed, args.steps)
    wall = time.time() - start
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    (args.out / "generation_config.json").unlink(missing_ok=True)
    figures = evaluate(args.out)
    training = {
        "seed": args.seed,
        "steps": args.steps,
        "hparams": HPARAMS,
        "train_seconds": round(wall, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **figures,
    }
    (args.out / "TRAINING.json").write_text(json.dumps(training, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out} in {wall:.0f}s of training")


if __name__ == "__main__":
    main()
