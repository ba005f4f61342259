"""FP8 static per-tensor (ModelOpt ``FP8``): E4M3 weight with one fp32 multiplier.

Stored per Linear: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` fp32 0-dim (= amax/448),
and ``input_scale`` fp32 0-dim (activation amax/448, used only by W8A8 kernels).

Decoding is ModelOpt's ``FP8QTensor.dequantize``: ``W = fp32(weight) * weight_scale`` (one
rounding in fp32), so results are bit-identical.  The quantizer divides in the weight's own
dtype, as ModelOpt's exporter does (``(W_bf16 / weight_scale).to(float8_e4m3fn)``).
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 [..., N, K] -> dense, computed in fp32 then cast to ``dtype``."""
    out = weight.to(torch.float32) * weight_scale.to(torch.float32)
    return out.to(dtype)


def fp8_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scale amax/448 in fp32 (weights and activations alike)."""
    return torch.as_tensor(amax).to(torch.float32) / E4M3_MAX


def quantize_fp8(w: torch.Tensor, weight_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense -> (fp8 weight, fp32 0-dim weight_scale), byte-equal to ModelOpt's exporter.

    The division runs in ``w``'s dtype (the 0-dim fp32 scale does not promote a bf16 tensor),
    which is what ModelOpt does; pass the weight in the export dtype (bf16).
    """
    if weight_scale is None:
        amax = torch.maximum(w.max().abs(), w.min().abs()).to(torch.float32)
        weight_scale = fp8_scale(amax)
    weight_scale = weight_scale.to(torch.float32).reshape(())
    q = (w / weight_scale).to(torch.float8_e4m3fn)
    return q, weight_scale
