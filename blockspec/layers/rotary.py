"""NeoX-style rotary position embedding (rotate_half over the full head_dim).

The pair for frequency i is (x[i], x[i + d/2]); angles are ``position * theta^(-2i/d)``.
cos/sin are always computed in fp32 and the rotation is done in fp32, then cast back.
On CUDA (inference) the rotation is one fused Triton kernel (``kernels/rotary.py``);
``kernels/rotary.apply_rotary_reference`` is the torch math it is tested against and what the
CPU runs.
"""
from __future__ import annotations

import torch
from torch import nn

from blockspec.kernels.rotary import apply_rotary_reference, rope_inv_freq, rotary, rotary_supported
from blockspec.kernels.triton_loader import use_triton


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0,
                 inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x [..., T, heads, d]`` at ``positions [..., T]`` (leading dims broadcast): the
    fused kernel on CUDA when it covers the call, else the reference."""
    if x.dim() < 3:
        raise ValueError(f"apply_rotary expects x [..., T, heads, d], got shape {tuple(x.shape)}")
    if inv_freq is None:
        inv_freq = rope_inv_freq(x.shape[-1], theta, device=x.device)
    if use_triton(x) and rotary_supported(x, positions, inv_freq):
        return rotary(x, positions, inv_freq)
    return apply_rotary_reference(x, positions, inv_freq=inv_freq)


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` as a non-persistent buffer (never part of a checkpoint)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = float(theta)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, positions, inv_freq=self.inv_freq)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"
