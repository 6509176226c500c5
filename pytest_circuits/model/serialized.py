"""torchao- and optimum-quanto-serialized checkpoints: identity, loading and the activation path.

torchao (``quant_method: torchao`` in config.json, written by ``save_pretrained`` of a model
quantized with a ``TorchAoConfig``) stores each quantized weight as a tensor subclass
(``Int8Tensor``: int8 ``qdata`` and per-row ``scale``); transformers loads it back as that
subclass and torchao's own linear runs: on a CPU a float x int8 matmul for weight-only configs,
and for ``Int8DynamicActivationInt8WeightConfig`` the input quantized per token to int8 and
``int_scaled_matmul`` (exact int32 sums). The read is the subclass's own ``dequantize()``.

optimum-quanto writes its own folder (``quanto_qmap.json`` beside model.safetensors, by
``QuantizedModelForCausalLM.save_pretrained``); transformers cannot save or load it, so it loads
here as quanto's ``from_pretrained`` does it (an empty model, then quanto's ``requantize`` with the
safetensors state dict), with eager attention. Its ``QLinear`` forward runs; the read is its
weight's ``dequantize()``: ``W = q * s`` (int8) or ``(q - z) * s`` per group (int4/int2).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError, RecipeError, first_line
from .checkpoint_keys import check_loading_info
from .compressed import require

QUANTO_MAP = "quanto_qmap.json"


def is_quanto_folder(folder: Path) -> bool:
    """True for a folder optimum-quanto saved (its quantization map beside the weights)."""
    return (Path(folder) / QUANTO_MAP).is_file()


def _subclass_counts(model: torch.nn.Module) -> tuple[Counter, int]:
    kinds: Counter = Counter()
    dense = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if type(weight) in (torch.Tensor, torch.nn.Parameter):
            dense += 1
        else:
            kinds[type(weight).__name__] += 1
    return kinds, dense


def _modules(model: torch.nn.Module) -> str:
    kinds, dense = _subclass_counts(model)
    held = ", ".join(f"{kind} x{n}" for kind, n in sorted(kinds.items()))
    return f"quantized {sum(kinds.values())} Linear ({held}); dense {dense} Linear"


def torchao_fields(model: torch.nn.Module, quant: dict) -> dict[str, str]:
    """Identity of a torchao checkpoint: its config type and granularity, modules, forward."""
    config = (quant.get("quant_type") or {}).get("default") or {}
    data = config.get("_data") or {}
    granularity = (data.get("granularity") or {}).get("_type", "?")
    group = f", group {data['group_size']}" if data.get("group_size") else ""
    dynamic = "DynamicActivation" in str(config.get("_type"))
    path = "input quantized per token to int8, then int_scaled_matmul" if dynamic else "float x int8 matmul"
    device = next(model.parameters()).device.type
    return {
        "quantization": f"{config.get('_type', '?')} ({granularity}{group}); {_modules(model)}",
        "forward": f"torchao's own linear on {device}: {path}",
    }


def quanto_fields(model: torch.nn.Module, qmap: dict) -> dict[str, str]:
    """Identity of an optimum-quanto folder: the weight and activation qtypes it names, modules, forward."""
    weights = Counter(str(v.get("weights")) for v in qmap.values())
    acts = Counter(str(v.get("activations")) for v in qmap.values())
    device = next(model.parameters()).device.type
    return {
        "quantization": f"weights {dict(weights)}, activations {dict(acts)}; {_modules(model)}",
        "forward": f"optimum-quanto's own QLinear forward on {device}",
    }


def require_quanto(what: str) -> None:
    """Import optimum-quanto, or refuse the checkpoint ``what`` in one line naming the extra."""
    require("optimum.quanto", "optimum-quanto", f"{what} (an optimum-quanto checkpoint)")


def load_quanto(folder: Path, what: str) -> torch.nn.Module:
    """An optimum-quanto folder as quanto reloads it (``requantize``), eager attention, on the CPU."""
    from ..fsio import JsonUnreadable, read_json
    from .loading import read_config

    require_quanto(what)
    from accelerate import init_empty_weights
    from optimum.quanto import requantize
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    try:
        qmap = read_json(folder / QUANTO_MAP)
    except JsonUnreadable as error:
        raise RecipeError(f"{what}: {QUANTO_MAP} {error.reason}; save the quanto checkpoint again") from None
    config = read_config(folder, what=what)  # the config errors of any other folder, in one line
    with init_empty_weights():
        model: Any = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # quanto's requantize loads with strict=False and leaves a missing tensor as uninitialised
    # memory: build the quantized modules with it, load here, and refuse what does not match
    requantize(model, state_dict={}, quantization_map=qmap)
    try:
        info = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    except RuntimeError as error:  # a tensor of another shape: torch lists each on a line of its own
        said = [line.strip() for line in str(error).splitlines() if "size mismatch" in line] or [first_line(error)]
        raise ModelLoadError(f"{what}: {said[0]}; re-save it with quanto's save_pretrained") from None
    tie = getattr(model.config, "tie_word_embeddings", True)
    tied = set(getattr(model, "all_tied_weights_keys", None) or ()) if tie else set()  # lm_head: the embedding
    missing = [key for key in info.missing_keys if key not in tied]
    check_loading_info({"missing_keys": missing, "unexpected_keys": info.unexpected_keys}, what)
    if tie:
        model.tie_weights()
    model.quanto_qmap = qmap
    return model


class TorchaoActivationQuant:
    """torchao's per-token int8 input quantization, for the self-check (`selfcheck._head_sum`)."""

    def __init__(self, module: torch.nn.Module):
        self.weight: Any = module.weight

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        from torchao.quantization.quantize_.common import _choose_quant_func_and_quantize_tensor

        w = self.weight
        q = _choose_quant_func_and_quantize_tensor(
            x.float(), w.act_quant_kwargs, scale=w.act_quant_scale, zero_point=w.act_quant_zero_point
        )
        return q.dequantize().double(), None

    def output(self, product: torch.Tensor, outlier: None, bias: torch.Tensor | None, dtype: torch.dtype):
        out = product if bias is None else product + bias.double().to(product.device)
        return out.to(dtype).double()


def torchao_activation_quant(module: torch.nn.Module) -> TorchaoActivationQuant | None:
    """The input quantizer of a torchao layer with dynamic activation quantization, else None."""
    weight = getattr(module, "weight", None)
    return TorchaoActivationQuant(module) if getattr(weight, "act_quant_kwargs", None) is not None else None
