"""Packed NVFP4 weights dequantized to 16-bit on the GPU, and the GEMMs that run on them.

At prefill sizes a W4A16 GEMM's cost is the tensor-core math, and where the in-tile decode
leaves the tensor cores idle (a short K loop per tile: the experts' down projection, K = 1856;
the shared expert) decoding the whole weight once into a scratch copy, then cuBLAS
(``F.linear``, ``torch._grouped_mm``), measures faster: the copy is written and read once
(~1.6 GB for 128 experts' down projections, 0.78 ms on an H200) while the GEMM runs at the
bf16 rate. ``w4a16_prefill.PREFILL_TABLE`` names the shapes and sizes where it wins (config
key ``dequant``); the launchers in ``w4a16.py`` dispatch here.

The dequantized weights are exactly the reference's (``dequantize_nvfp4`` of the checkpoint
bytes, cast to the activations' dtype): the Triton kernel (``_nvfp4_dequant_kernels.py``) does
the same fp32 products and one rounding.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.kernels.relu2 import relu2 as relu2_kernel
from blockspec.kernels.relu2 import relu2_reference
from blockspec.kernels.triton_loader import interpreting, load_kernels
from blockspec.kernels.w4a16_layout import from_kernel_layout
from blockspec.quant.nvfp4 import GROUP_SIZE, dequantize_nvfp4

_KERNELS = Path(__file__).with_name("_nvfp4_dequant_kernels.py")
# rows x uint16 words (4 weights each) per program: the best of scripts/bench_nvfp4_dequant.py
# on an H200 (128 experts' down projections: 0.78 ms, 2.1 TB/s, against 0.92 ms for 32 x 64)
BLOCK_N, BLOCK_W, NUM_WARPS = 16, 32, 4


def _check(weight: torch.Tensor, weight_scale: torch.Tensor,
           weight_scale_2: torch.Tensor) -> tuple[int, int, int]:
    if weight.dtype != torch.uint8 or weight.dim() not in (2, 3):
        raise ValueError(f"packed weight must be uint8 [N, K/2] or [E, N, K/2], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    e = weight.shape[0] if weight.dim() == 3 else 1
    n, k = weight.shape[-2], weight.shape[-1] * 2
    if k % GROUP_SIZE or tuple(weight_scale.shape) != (*weight.shape[:-1], k // GROUP_SIZE):
        raise ValueError(f"weight_scale must be {(*weight.shape[:-1], k // GROUP_SIZE)} for a "
                         f"packed weight of K={k} (a multiple of {GROUP_SIZE}), got "
                         f"{tuple(weight_scale.shape)}")
    if weight_scale_2.numel() != e:
        raise ValueError(f"weight_scale_2 needs one value per expert ({e}), got "
                         f"{weight_scale_2.numel()}")
    return e, n, k


def nvfp4_dequant_reference(weight: torch.Tensor, weight_scale: torch.Tensor,
                            weight_scale_2: torch.Tensor,
                            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``nvfp4_dequant`` in torch: the checkpoint bytes back, then ``dequantize_nvfp4``."""
    e, _, _ = _check(weight, weight_scale, weight_scale_2)
    s2 = weight_scale_2.reshape(e, 1, 1) if weight.dim() == 3 else weight_scale_2.reshape(())
    return dequantize_nvfp4(from_kernel_layout(weight), weight_scale, s2, dtype=dtype)


def nvfp4_dequant(weight: torch.Tensor, weight_scale: torch.Tensor,
                  weight_scale_2: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                  block_n: int = BLOCK_N, block_w: int = BLOCK_W,
                  num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Kernel-layout packed ``[E, N, K/2]`` (or ``[N, K/2]``) with E4M3 scales ``[.., K/16]``
    and one global scale per expert -> ``[E, N, K]`` (or ``[N, K]``) in ``dtype``. The tile
    keywords are for ``scripts/bench_nvfp4_dequant.py``."""
    e, n, k = _check(weight, weight_scale, weight_scale_2)
    w3 = weight if weight.dim() == 3 else weight.unsqueeze(0)
    s3 = (weight_scale if weight_scale.dim() == 3 else weight_scale.unsqueeze(0))
    if w3.stride(-1) != 1 or w3.stride(-2) % 2 or w3.data_ptr() % 2:
        w3 = w3.contiguous()
    s3 = s3.view(torch.uint8)
    s2 = weight_scale_2.reshape(e).to(torch.float32).contiguous()
    out_dtype = torch.float32 if interpreting() else dtype   # the interpreter's bf16 casts
    out = torch.empty((e, n, k), dtype=out_dtype, device=weight.device)
    if out.numel():
        words = k // 4
        grid = (-(-n // block_n), -(-words // block_w), e)
        load_kernels(_KERNELS)._nvfp4_dequant_kernel[grid](
            w3, s3, s2, out, n, words, w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1),
            out.stride(0), out.stride(1), BLOCK_N=block_n, BLOCK_W=block_w,
            **({} if interpreting() else {"num_warps": num_warps}))
    out = out if out.dtype == dtype else out.to(dtype)
    return out if weight.dim() == 3 else out[0]


def _relu2(y: torch.Tensor) -> torch.Tensor:
    return relu2_reference(y) if interpreting() or not y.is_cuda else relu2_kernel(y)


def dequant_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   weight_scale_2: torch.Tensor, relu2: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T`` on the weight dequantized to x's dtype (cuBLAS on the GPU); ``relu2``
    squares the relu of the rounded product, as the W4A16 kernel's epilogue does."""
    y = F.linear(x, nvfp4_dequant(weight, weight_scale, weight_scale_2, x.dtype))
    return _relu2(y) if relu2 else y


def dequant_grouped(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                    relu2: bool = False) -> torch.Tensor:
    """Grouped ``grouped_w4a16`` (rows of x sorted by expert, ``expert_offsets`` [E'+1] over
    the stack's first E' experts) through ``torch._grouped_mm`` on the dequantized experts."""
    experts = expert_offsets.numel() - 1
    w = nvfp4_dequant(weight[:experts], weight_scale[:experts],
                      weight_scale_2.reshape(-1)[:experts], x.dtype)
    offs = expert_offsets[1:].to(device=x.device, dtype=torch.int32)
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return _relu2(y) if relu2 else y
