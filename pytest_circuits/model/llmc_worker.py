"""Run llm-compressor's GPTQ or AWQ (or FP8 with an fp8 KV cache) on a float32 checkpoint; write a compressed-tensors checkpoint.

Run as a script by `calibrated` under the Python of an environment that has llm-compressor
(it pins transformers <= 5.17 and compressed-tensors 0.19, so it cannot share ours): it imports
nothing from pytest_circuits. The calibration token ids come in a safetensors file
(``input_ids``: ``(n, L)`` int64) made by the caller; the scheme is int4 weights, symmetric,
group-wise scales (``group_size``), ``lm_head`` left dense. Usage::

    python llmc_worker.py METHOD FOLDER OUT CALIBRATION GROUP_SIZE
"""

from __future__ import annotations

import sys

KV_CACHE_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def scheme(group_size: int) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size}
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def processor(folder: str, vocab: int):
    """The folder's tokenizer; a model without one (token ids only) gets a word-level stand-in,
    which llm-compressor needs only to collate the already tokenized calibration ids."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError):
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        words = WordLevel({str(i): i for i in range(vocab)}, unk_token="0")
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), pad_token="0")


def main(method: str, folder: str, out: str, calibration: str, group_size: str) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if not torch.cuda.is_available():
        from llmcompressor.pipelines.cache import IntermediatesCache

        # AWQ pins its cached activations for faster host-to-GPU copies; a CPU-only torch cannot
        # pin (llm-compressor 0.14 raises), and pinning never changes a value: skip it
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    ids = load_file(calibration)["input_ids"]
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    if method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = GPTQModifier(config_groups=scheme(int(group_size)), ignore=["lm_head"])
    elif method == "awq":
        from llmcompressor.modifiers.awq import AWQModifier

        recipe = AWQModifier(config_groups=scheme(int(group_size)), ignore=["lm_head"])
    elif method == "fp8-kv":  # FP8_DYNAMIC weights and a static fp8 cache calibrated on the ids (KV_CACHE_FP8)
        from llmcompressor.modifiers.quantization import QuantizationModifier

        recipe = QuantizationModifier(
            targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"], kv_cache_scheme=KV_CACHE_FP8
        )
    else:
        raise SystemExit(f"unknown method {method!r}; use gptq, awq or fp8-kv")
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        max_seq_length=ids.shape[1],
        num_calibration_samples=ids.shape[0],
        pipeline="sequential",
        processor=processor(folder, model.config.vocab_size),
    )
    model.save_pretrained(out, save_compressed=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
