"""LLM.int8() as a bitsandbytes ``Linear8bitLt`` computes it: activation quantization and output rounding.

bitsandbytes 0.50 (``MatMul8bitLt`` with ``int8_vectorwise_quant``, ``int8_mixed_scaled_mm``,
``int8_mm_dequant``) computes an int8 layer's output for an input ``X`` of ``R`` rows (tokens):

- ``A = fp16(X)``; with a threshold ``tau > 0`` the outliers are the entries ``|A_ij| >= tau``
  and the outlier columns ``C`` those holding any outlier;
- the row scale is ``m_i = max_j |A_ij|`` over the non-outlier entries (float32) and the codes
  are ``q_ij = round(A_ij * (127 / m_i))`` (a float32 product), 0 at the outliers and, when
  ``R > 1``, 0 on all of ``C`` (a row with ``m_i = 0`` gets codes 0 here);
- the int8 product ``P = X_q W^T`` with ``X_q = q m / 127`` and ``W = CB SCB / 127`` (the dense
  weight `dense.dense_weight` reads) comes out of exact int32 sums times ``m_i SCB_o c``, where
  bitsandbytes' constant ``c`` for ``1/127^2`` is 6.200124e-05 in its PyTorch kernel (CPU and
  every non-CUDA device: 1.8e-5 high) and 6.200012e-05 in its CUDA kernel; the bias is added,
  and the CUDA kernel rounds to float16 (adding a non-float16 bias after that rounding); the
  result is cast to ``X``'s dtype;
- the outlier columns are added in ``X``'s dtype: ``+ X[:, C] W[:, C]^T``.

`Int8Layer.split` gives ``X_q`` and ``X_C`` (``X`` on ``C``, 0 elsewhere; for one row bitsandbytes
keeps the codes on ``C`` too and adds ``X_C`` on top) in float64; `Int8Layer.output` turns the
float64 products ``X_q W^T`` and ``X_C W^T`` into what the layer returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .dense import bnb_kind

INT8_MAX = 127.0
DEQUANT_CONSTANT = {"cuda": 6.200012e-05, "default": 6.200124e-05}  # bitsandbytes' 1/127^2, per kernel


@dataclass(frozen=True)
class Int8Layer:
    """An LLM.int8() layer's activation path: its outlier threshold and the device type it runs on."""

    threshold: float
    device_type: str

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(X_q, X_C)`` in float64, the shape of ``x``; ``X_C`` is None without outlier columns."""
        rows = x.reshape(-1, x.shape[-1])
        half = rows.to(torch.float16).float()  # the float16 cast, held exactly in float32
        outliers = half.abs() >= self.threshold if self.threshold > 0.0 else torch.zeros_like(half, dtype=torch.bool)
        columns = outliers.any(dim=0)
        kept = half.masked_fill(outliers, 0.0)
        absmax = kept.abs().amax(dim=-1, keepdim=True)
        codes = torch.round(kept * (INT8_MAX / absmax.clamp_min(torch.finfo(torch.float32).tiny)))
        codes = codes.masked_fill(absmax == 0, 0.0)
        if not bool(columns.any()):
            return (codes.double() * (absmax.double() / INT8_MAX)).reshape(x.shape), None
        if rows.shape[0] > 1:
            codes = codes.masked_fill(columns, 0.0)
        dequantized = codes.double() * (absmax.double() / INT8_MAX)
        exact = rows.double().masked_fill(~columns, 0.0)
        return dequantized.reshape(x.shape), exact.reshape(x.shape)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """``X_q + X_C`` (float64): what the layer's weight really multiplies."""
        quantized, outlier = self.split(x)
        return quantized if outlier is None else quantized + outlier

    def output(
        self,
        product: torch.Tensor,
        outlier_product: torch.Tensor | None,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The layer's output (float64) from ``X_q W^T`` and ``X_C W^T`` (exact, float64), for input dtype ``dtype``."""
        kernel = "cuda" if self.device_type == "cuda" else "default"
        out = product * (DEQUANT_CONSTANT[kernel] * INT8_MAX**2)
        bias = None if bias is None else bias.double().to(out.device)
        if kernel == "cuda":
            fused = bias is not None and dtype == torch.float16  # the module casts its bias to X's dtype
            out = (out + bias if fused and bias is not None else out).to(torch.float16)
            if bias is not None and not fused:
                out = (out.double() + bias).to(torch.float16)
        elif bias is not None:
            out = out + bias
        out = out.to(dtype).double()
        return out if outlier_product is None else (out + outlier_product).to(dtype).double()


def int8_layer(module: torch.nn.Module) -> Int8Layer | None:
    """The activation path of a ``Linear8bitLt`` that quantizes its input, else None.

    None for every other layer, and for an int8 layer in training mode on CPU/XPU, where
    bitsandbytes multiplies by the dequantized weight instead (``MatMul8bitFp``).
    """
    if bnb_kind(module) != "int8":
        return None
    weight = getattr(module, "weight", None)
    device_type = weight.device.type if isinstance(weight, torch.Tensor) else "cpu"
    if module.training and device_type in ("cpu", "xpu"):
        return None
    state: Any = getattr(module, "state", None)  # bitsandbytes' MatmulLtState (untyped)
    return Int8Layer(float(getattr(state, "threshold", 0.0) or 0.0), device_type)
