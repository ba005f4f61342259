"""Fused NeoX rotary embedding for the GPU: one launch instead of the reference's ten or so small
kernels (casts, angle product, cat, cos, sin, neg, cat, products, sum, cast), which the draft
models pay for q and k in every layer of every speculative step. The torch reference
(``apply_rotary_reference``, with the angle helpers it shares) is below; ``layers/rotary.apply_rotary``
calls the kernel on CUDA."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_rotary_kernels.py")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_POS_DTYPES = (torch.int64, torch.int32)
# At most this many (x[i], x[i + d/2]) pairs per program (16 heads at d = 128): a decode row of
# 32 heads still spreads over two programs, a 32k-row prefill gets one program per row and head
# block, and cos/sin are computed once per program, not once per head.
_PAIRS_PER_PROGRAM = 1024


def _arg(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor; under the interpreter also one that starts its storage (it
    mishandles views with a storage offset)."""
    t = t.contiguous()
    return t.clone() if interpreting() and t.storage_offset() != 0 else t


def rotary_supported(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> bool:
    """Whether the kernel covers this call: a float x [..., T, heads, d], integer positions on
    x's device that broadcast to x's leading dims (so the result keeps x's shape) and d/2
    frequencies. Anything else runs the reference."""
    if not (x.dim() >= 3 and x.dtype in _DTYPES and positions.dtype in _POS_DTYPES
            and positions.device == x.device and x.shape[-1] % 2 == 0
            and inv_freq.numel() == x.shape[-1] // 2 and positions.dim() <= x.dim() - 2):
        return False
    try:
        return torch.broadcast_shapes(positions.shape, x.shape[:-2]) == x.shape[:-2]
    except RuntimeError:
        return False


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x [..., T, heads, d]`` rotated at ``positions`` (broadcast to ``x.shape[:-2]``) with
    frequencies ``inv_freq [d/2]``, as a new tensor of x's shape and dtype."""
    heads, d = x.shape[-2], x.shape[-1]
    half = d // 2
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    rows = y.numel() // (heads * d)
    x3 = x.reshape(rows, heads, d)
    # Compiled, any row and head strides do (a slice of a fused projection, say); the last dim
    # must be contiguous.
    if x3.stride(-1) != 1 or interpreting():
        x3 = _arg(x3)
    pos = _arg(positions.expand(x.shape[:-2]).reshape(rows))
    freq = _arg(inv_freq.to(device=x.device, dtype=torch.float32))
    block_d = next_pow2(half)
    block_h = min(next_pow2(heads), max(1, _PAIRS_PER_PROGRAM // block_d))
    grid = (rows, (heads + block_h - 1) // block_h)
    # FMA contraction off: the reference rounds each product before the sum.
    extra = {} if interpreting() else {"num_warps": 4, "enable_fp_fusion": False}
    load_kernels(_KERNELS)._rotary_kernel[grid](
        x3, pos, freq, y, heads, half, x3.stride(0), x3.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d, **extra)
    return y


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
