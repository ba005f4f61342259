"""FP8 (E4M3) activation quantization for the W8A8 linears in one launch.

In torch it is a cast, a divide, a clamp and the fp8 cast (several kernels per projection,
which at decode batch sizes cost more in launches than in bytes). The kernel reads the scale
from device memory, so neither path reads anything back to the host. It matches
``quantize_fp8_act_reference`` (that torch code, kept for the tests, the CPU and the pure-torch
W8A8 reference) bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_fp8_quant_kernels.py")

E4M3_MAX = 448.0


def quantize_fp8_act_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [..., K] divided by the 0-dim ``scale`` in fp32, clamped to +-448, cast to E4M3
    (round to nearest even)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_act(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fused form of ``quantize_fp8_act_reference`` (same arguments; ``scale`` on x's device,
    one element, read by the kernel): one program per row and block of columns."""
    if scale.numel() != 1:
        raise ValueError(f"quantize_fp8_act: per-tensor scale expected, got shape "
                         f"{list(scale.shape)}")
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if out.numel():
        block = min(1024, next_pow2(k, 16))
        load_kernels(_KERNELS)._fp8_quant_kernel[(rows.shape[0], -(-k // block))](
            rows, scale, out, k, rows.stride(0), out.stride(0), BLOCK_K=block,
            **({} if interpreting() else {"num_warps": 4}))
    return out.reshape(x.shape)
