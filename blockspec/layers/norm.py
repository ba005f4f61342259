"""RMSNorm variants used by Nemotron-H and the Qwen3-style draft layers."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) computed in fp32, times ``weight`` (no +1 offset)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = gate.dtype
        v = y.float() * F.silu(gate.float())
        shape = v.shape
        v = v.view(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * v.view(shape).to(dtype)
