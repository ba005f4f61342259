"""Fused norms for the GPU: RMSNorm (optionally with the residual add before it) and Mamba-2's
gated group RMSNorm, one kernel each instead of five to eight small ones. The torch references
are the modules in ``layers/norm.py``, which call these on CUDA. ``fp8_scale`` (a static
per-tensor scale on the device) makes the output E4M3: the input quantization of the FP8 linear
that follows, bit for bit ``quantize_fp8_act`` of the unquantized output, without its launch."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_norm_kernels.py")


def _scale(fp8_scale: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    if fp8_scale is None:
        return dummy                      # never read (FP8 off)
    if fp8_scale.numel() != 1:
        raise ValueError(f"fp8_scale: one per-tensor scale expected, got shape "
                         f"{list(fp8_scale.shape)}")
    return fp8_scale


def _warps(block: int) -> dict:
    return {} if interpreting() else {"num_warps": 8 if block >= 2048 else 4}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             fp8_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x (+ residual, in x's dtype), y = weight * h / rms(h) in x's dtype (E4M3
    at ``fp8_scale`` when given). With no residual, h is x itself."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2, dtype=torch.float8_e4m3fn if fp8_scale is not None else None)
    rows = x2.shape[0]
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        h = torch.empty_like(x2)
    else:
        r2, h = x2, x2
    block = next_pow2(n, 16)
    load_kernels(_KERNELS)._rms_norm_kernel[(rows,)](
        x2, r2, weight, y, h, _scale(fp8_scale, weight), n, eps, x2.stride(0), r2.stride(0),
        y.stride(0), h.stride(0), BLOCK=block, HAS_RES=residual is not None,
        FP8=fp8_scale is not None, **_warps(block))
    return h.view(x.shape), y.view(x.shape)


def gated_rms_norm(v: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int,
                   eps: float, fp8_scale: torch.Tensor | None = None) -> torch.Tensor:
    """weight * normalise_per_group(v * silu(z)), in z's dtype (v may be fp32; E4M3 at
    ``fp8_scale`` when given)."""
    n = v.shape[-1]
    v2, z2 = v.reshape(-1, n), z.reshape(-1, n)
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    y = torch.empty(z2.shape, dtype=torch.float8_e4m3fn if fp8_scale is not None else z.dtype,
                    device=z.device)
    block = next_pow2(group, 16)
    load_kernels(_KERNELS)._gated_rms_norm_kernel[(v2.shape[0], n // group)](
        v2, z2, weight, y, _scale(fp8_scale, weight), group, eps, v2.stride(0), z2.stride(0),
        y.stride(0), BLOCK=block, FP8=fp8_scale is not None, **_warps(block))
    return y.view(z.shape)
