#!/usr/bin/env python
"""Train the embedded default model ``tiny-induction``: 2 layers, 4 heads, d_model 128, RoPE.

Deterministic (seeded torch, numpy PCG64, one thread) and CPU-only: about four minutes here.
Each training sequence is 256 tokens of back-to-back segments ``[x, x]`` with ``x``
uniform over the 512 ids and ``len(x)`` uniform in 4..64. The loss is the next-token
cross-entropy, weighted 1 on the second copies and 0.1 on the first copies (these are
unpredictable; the small weight keeps the model calibrated there, near ln 512).

One induction head, not four. Trained plainly, all four layer-1 heads become induction
heads together and share the work, so knocking out any one of them moves copy loss by
about 0.1 nats. Two choices break that symmetry:

- head L1H0's slices of ``W_Q``, ``W_K``, ``W_V`` and ``W_O`` start at 3x the init scale,
  so the circuit forms there first;
- the loss adds ``lambda * sum_h ||W_O^h W_V^h||_F ** 0.5`` over every head. The power 1/2
  makes the penalty concave in a head's OV size, so one strong head costs less than
  several weak ones doing the same job (weight decay, an L2 penalty, favours sharing).
  Either choice alone still gave redundant induction heads.

A previous-token head forms in layer 0 and the induction head in layer 1. The saved
folder holds ``config.json`` and ``model.safetensors`` (no tokenizer: every id is
ordinary) plus ``TRAINING.json``, with the probe, kappa and knockout figures measured by
the package's own code.

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
    "first_copy_weight": 0.1,
    "leader_head": [1, 0],
    "leader_init_scale": 3.0,
    "head_ov_penalty": 0.01,
    "head_ov_penalty_power": 0.5,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: the shipped model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000)
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
    """Ids ``(B, T)`` of back-to-back ``[x, x]`` segments, and each token's loss weight ``(B, T)``."""
    h = HPARAMS
    low, high = h["segment_length"]
    T, V = h["sequence_length"], h["vocab_size"]
    ids = np.empty((h["batch_size"], T), dtype=np.int64)
    second = np.empty((h["batch_size"], T), dtype=bool)
    for row in range(h["batch_size"]):
        parts, copies, filled = [], [], 0
        while filled < T:
            x = rng.integers(0, V, int(rng.integers(low, high + 1)))
            parts += [x, x]
            copies += [np.zeros(x.size, dtype=bool), np.ones(x.size, dtype=bool)]
            filled += 2 * x.size
        ids[row] = np.concatenate(parts)[:T]
        second[row] = np.concatenate(copies)[:T]
    weights = np.where(second, 1.0, h["first_copy_weight"]).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(weights)


def head_shape() -> tuple[int, int]:
    """``(n_heads, d_head)``."""
    n = HPARAMS["num_attention_heads"]
    return n, HPARAMS["hidden_size"] // n


def scale_leader_init(model: LlamaForCausalLM) -> None:
    """Multiply the leader head's rows of ``W_Q, W_K, W_V`` and columns of ``W_O`` by its init scale."""
    (layer, head), scale = HPARAMS["leader_head"], HPARAMS["leader_init_scale"]
    _, dh = head_shape()
    attn = model.model.layers[layer].self_attn
    rows = slice(head * dh, (head + 1) * dh)
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[rows] *= scale
        attn.o_proj.weight[:, rows] *= scale


def head_ov_penalty(model: LlamaForCausalLM) -> torch.Tensor:
    """``sum_h ||W_O^h W_V^h||_F ** p`` over every head of every layer (concave for p < 1)."""
    n, dh = head_shape()
    total = torch.zeros(())
    for layer in model.model.layers:
        attn = layer.self_attn
        W_O = attn.o_proj.weight.view(-1, n, dh).transpose(0, 1)  # (n, d_model, d_head)
        W_V = attn.v_proj.weight.view(n, dh, -1)  # (n, d_head, d_model)
        sizes = torch.linalg.matrix_norm(W_O @ W_V) + 1e-6
        total = total + sizes.pow(HPARAMS["head_ov_penalty_power"]).sum()
    return total


def train(seed: int, steps: int) -> LlamaForCausalLM:
    """AdamW on the weighted next-token loss plus the head-OV penalty; constant lr, clipping."""
    torch.manual_seed(seed)
    rng = np.random.Generator(np.random.PCG64(seed))
    model = LlamaForCausalLM(model_config())
    scale_leader_init(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=HPARAMS["lr"], weight_decay=HPARAMS["weight_decay"])
    start = time.time()
    for step in range(steps):
        ids, weights = training_batch(rng)
        logits = model(ids).logits[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        weights = weights[:, 1:]
        loss = (ce * weights).sum() / weights.sum() + HPARAMS["head_ov_penalty"] * head_ov_penalty(model)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HPARAMS["grad_clip"])
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            copy_loss = ce[weights == 1.0].mean().item()
            print(f"step {step:5d}  copy loss {copy_loss:.3f}  {time.time() - start:6.1f}s", flush=True)
    return model.eval()


def evaluate(folder: Path) -> dict:
    """The shipped figures, measured by the package itself (probe, kappa, knockouts)."""
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.weights import extract_weights
    from pytest_circuits.rungs.kappa import ov_spectrum
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.probe import run_repeat_probe
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

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
