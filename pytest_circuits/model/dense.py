"""Dense float32 ``(out, in)`` weights of any projection layer, quantized or not.

Handles ``nn.Linear``, GPT-2's ``Conv1D`` (stored ``(in, out)``), bitsandbytes
``Linear8bitLt`` (int8 rows times ``SCB / 127``) and ``Linear4bit``
(``bitsandbytes.functional.dequantize_4bit``, or the CPU-packed layout bitsandbytes switches a
4-bit weight to at its first inference forward on AVX512-BF16 CPUs). Analysis always reads these.
"""

from __future__ import annotations

from typing import Any

import torch

BNB_LAYERS = {"Linear8bitLt": "int8", "Linear4bit": "4bit", "LinearNF4": "4bit", "LinearFP4": "4bit"}


def bnb_kind(module: torch.nn.Module) -> str | None:
    """``"int8"`` or ``"4bit"`` for a bitsandbytes layer, else None."""
    return BNB_LAYERS.get(type(module).__name__)


def bnb_4bit_compute_dtype(requested: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype bitsandbytes' 4-bit matmuls actually compute in: on a CPU with AVX512-BF16 its
    CPU backend (0.49 and later) casts the input to bfloat16 whatever the build asked for, so
    such builds are as exact as bfloat16, not float32."""
    if device.type != "cpu":
        return requested
    try:
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return requested
    return torch.bfloat16 if has_avx512bf16() else requested


def weight_of(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` as the tensor it is (torch types a module attribute ``Tensor | Module``)."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is a {type(weight).__name__}, not a tensor")
    return weight


def dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """The layer's weight as float32 ``(out_features, in_features)``, dequantized if needed."""
    kind = bnb_kind(module)
    weight = weight_of(module)
    if kind == "int8":
        import bitsandbytes.functional as bnbf

        scb = getattr(weight, "SCB", None)
        if scb is None:  # bitsandbytes keeps SCB on the module on some versions
            state: Any = module.state  # bitsandbytes' MatmulLtState (untyped), not a Tensor or Module
            scb = state.SCB
        if weight.dtype != torch.int8:  # not yet quantized (still on the host before .cuda())
            return weight.detach().float()
        return bnbf.int8_vectorwise_dequant(weight.data, scb).float()
    if kind == "4bit":
        import bitsandbytes.functional as bnbf

        quant_state = getattr(weight, "quant_state", None)
        if quant_state is None:
            return weight.detach().float()
        if getattr(quant_state, "packing_format_for_cpu", False):
            return dequantize_cpu_packed_4bit(weight.data, quant_state)
        return bnbf.dequantize_4bit(weight.data, quant_state).float()
    if type(weight) is not torch.Tensor and type(weight) is not torch.nn.Parameter and hasattr(weight, "dequantize"):
        weight = weight.dequantize()  # a quantized tensor subclass (torchao's Int8Tensor, ...)
    if type(module).__name__ == "Conv1D":
        return weight.detach().float().T
    return weight.detach().float()


def dense_rows(module: torch.nn.Module, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of `dense_weight` (float32, CPU): a plain ``nn.Linear`` or
    ``nn.Embedding`` weight is sliced before the cast, so only those rows are ever copied; any
    other layer (quantized, ``Conv1D``) is dequantized whole and sliced."""
    weight = weight_of(module)
    plain = type(weight) in (torch.Tensor, torch.nn.Parameter) and bnb_kind(module) is None
    if plain and type(module).__name__ != "Conv1D":
        return weight.detach()[start:stop].float().cpu()
    return dense_weight(module)[start:stop].cpu()


CPU_PACK_BLOCK_N = 32  # rows per block of bitsandbytes' CPU-packed 4-bit layout


def dequantize_cpu_packed_4bit(packed: torch.Tensor, quant_state: Any) -> torch.Tensor:
    """Dense float32 ``(N, K)`` weight of a 4-bit layer in bitsandbytes' CPU-packed layout.

    bitsandbytes >= 0.49 repacks a ``Linear4bit`` weight at its first eval, no-grad forward on
    an AVX512-BF16 CPU: ``packed`` is ``(N, K/2)`` bytes where, per block of 32 rows and pair of
    columns, byte ``j`` of the 64 codes ``(row, col)`` holds code ``j`` in its low and code
    ``j + 32`` in its high nibble; ``quant_state.absmax`` becomes bfloat16 ``(K / blocksize, N)``.
    Then ``W[n, k] = code[q[n, k]] * absmax[k // blocksize, n]``: exactly what its matmul uses
    (the bfloat16 absmax included), read without changing the module.
    """
    n_rows, half = packed.shape
    width = 2 * CPU_PACK_BLOCK_N
    nibbles = packed.reshape(-1, CPU_PACK_BLOCK_N)
    codes = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(-1, width)
    codes = codes.reshape(n_rows // CPU_PACK_BLOCK_N, half, CPU_PACK_BLOCK_N, 2).transpose(1, 2)
    index = codes.reshape(n_rows, 2 * half).long()
    absmax = quant_state.absmax.float().T.repeat_interleave(quant_state.blocksize, dim=1)  # (N, K)
    return quant_state.code.float().to(packed.device)[index] * absmax


def is_conv1d(module: torch.nn.Module) -> bool:
    """GPT-2's ``Conv1D``: its weight is stored ``(in, out)``, the transpose of ``nn.Linear``'s."""
    return type(module).__name__ == "Conv1D"


def float_weight(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` for an in-place edit (sabotage, graded damage); a TypeError for a quantized one."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    if not weight.dtype.is_floating_point or bnb_kind(module) is not None:
        raise TypeError(f"sabotage edits float weights only; {type(module).__name__} is quantized: edit the fp32 build")
    return weight


def head_columns(proj: torch.nn.Module, weight: torch.Tensor, cols: slice) -> torch.Tensor:
    """The view of an output projection's ``weight`` that multiplies columns ``cols`` of z (one
    head's ``W_O``): ``weight[:, cols]`` (``nn.Linear``, ``(d_model, d_head)``) or ``weight[cols, :]``
    (`is_conv1d`, ``(d_head, d_model)``); an in-place edit of the view edits the weight."""
    return weight[cols, :] if is_conv1d(proj) else weight[:, cols]


def dense_bias(module: torch.nn.Module) -> torch.Tensor | None:
    """The layer's bias as float32, or None."""
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach().float()


def is_projection(module: torch.nn.Module) -> bool:
    """True for a layer whose weight `dense_weight` can read."""
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D" or bnb_kind(module) is not None
