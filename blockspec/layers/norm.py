"""RMSNorm variants used by Nemotron-H and the Qwen3-style draft layers. On CUDA (inference)
each runs as one fused Triton kernel (``kernels/norm.py``); ``reference`` is the torch math the
kernels are tested against and what the CPU runs. ``fp8_scale``: return the output quantized to
E4M3 at that static scale (the next FP8 linear's input quantization, fused into the norm)."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from blockspec.kernels.fp8_quant import quantize_fp8_act_reference
from blockspec.kernels.norm import gated_rms_norm, rms_norm
from blockspec.kernels.triton_loader import use_triton


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) computed in fp32, times ``weight`` (no +1 offset)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, fp8_scale: torch.Tensor | None = None) -> torch.Tensor:
        if use_triton(x):
            return rms_norm(x, self.weight, self.eps, fp8_scale=fp8_scale)[1]
        return _to_fp8(self.reference(x), fp8_scale)

    def add_forward(self, h: torch.Tensor, out: torch.Tensor,
                    fp8_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm block step: (h + out, norm(h + out)), the sum in h's dtype."""
        if use_triton(h):
            return rms_norm(h, self.weight, self.eps, residual=out, fp8_scale=fp8_scale)
        h = h + out
        return h, _to_fp8(self.reference(h), fp8_scale)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(dtype)


class GatedGroupRMSNorm(nn.Module):
    """Mamba-2 output norm: gate first (y * silu(z)), then RMS-normalise each channel group.

    Gating after the norm is a silent numerical bug, so the order lives in exactly one place.
    """

    def __init__(self, dim: int, group_size: int, eps: float = 1e-6,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"gated norm: dim {dim} is not a multiple of group size {group_size}")
        self.eps = eps
        self.group_size = group_size
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, y: torch.Tensor, gate: torch.Tensor,
                fp8_scale: torch.Tensor | None = None) -> torch.Tensor:
        if use_triton(gate):
            return gated_rms_norm(y, gate, self.weight, self.group_size, self.eps,
                                  fp8_scale=fp8_scale)
        return _to_fp8(self.reference(y, gate), fp8_scale)

    def reference(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = gate.dtype
        v = y.float() * F.silu(gate.float())
        shape = v.shape
        v = v.view(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * v.view(shape).to(dtype)


def _to_fp8(y: torch.Tensor, fp8_scale: torch.Tensor | None) -> torch.Tensor:
    if fp8_scale is None:
        return y
    return quantize_fp8_act_reference(y, fp8_scale)
