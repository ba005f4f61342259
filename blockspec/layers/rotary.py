"""NeoX-style rotary position embedding (rotate_half over the full head_dim).

The pair for frequency i is (x[i], x[i + d/2]); angles are ``position * theta^(-2i/d)``.
cos/sin are always computed in fp32 and the rotation is done in fp32, then cast back.
On CUDA (inference) the rotation is one fused Triton kernel (``kernels/rotary.py``);
``apply_rotary_reference`` is the torch math it is tested against and what the CPU runs.
"""
from __future__ import annotations

import torch
from torch import nn

from blockspec.kernels.triton_loader import use_triton


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """``theta^(-2i/d)`` for i in 0..d/2-1, fp32."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (float(theta) ** exponent)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``positions.shape + (head_dim,)`` in fp32 (halves duplicated)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device, torch.float32)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0,
                 inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x [..., T, heads, d]`` at ``positions [..., T]`` (leading dims broadcast): the
    fused kernel on CUDA when it covers the call, else the reference."""
    if x.dim() < 3:
        raise ValueError(f"apply_rotary expects x [..., T, heads, d], got shape {tuple(x.shape)}")
    if inv_freq is None:
        inv_freq = rope_inv_freq(x.shape[-1], theta, device=x.device)
    if use_triton(x):
        from blockspec.kernels.rotary import rotary, rotary_supported

        if rotary_supported(x, positions, inv_freq):
            return rotary(x, positions, inv_freq)
    return apply_rotary_reference(x, positions, inv_freq=inv_freq)


def apply_rotary_reference(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0,
                           inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """The torch math of ``apply_rotary`` (the kernel's reference): angles, cos/sin and the
    rotation in fp32, cast back to x's dtype."""
    if x.dim() < 3:
        raise ValueError(f"apply_rotary expects x [..., T, heads, d], got shape {tuple(x.shape)}")
    if inv_freq is None:
        inv_freq = rope_inv_freq(x.shape[-1], theta, device=x.device)
    cos, sin = rope_cos_sin(positions, inv_freq)           # [..., T, d]
    cos = cos.unsqueeze(-2)                                 # [..., T, 1, d]
    sin = sin.unsqueeze(-2)
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


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
