"""GEMMs of a few rows (decode, verify, draft blocks) as one weight pass.

At 1-8 rows a dense projection is a weight read: cuBLAS picks split-K kernels for these shapes
(two launches, 1.7-2.1 TB/s on an H200 for the 10-60 MB matrices of Lightning's Mamba, attention,
shared-expert and draft projections). Here each program reads a 16-column weight tile once and
multiplies it into every row (the per-pair MoE GEMV's tile, swept in docs/benchmarks.md). The
reference is ``F.linear``; ``linear`` picks the kernel where it applies.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2, use_triton

_KERNELS = Path(__file__).with_name("_skinny_gemm_kernels.py")
MAX_ROWS = 8                 # past this the weight tile no longer amortises well: cuBLAS
MAX_COLUMNS = 65536          # the 131k-row lm_head already streams at bandwidth in cuBLAS
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` runs the kernel for this call."""
    k = weight.shape[-1]
    return (weight.dim() == 2 and x.shape[-1] == k and x.dtype in _DTYPES
            and weight.dtype in _DTYPES and weight.stride(-1) == 1
            and weight.shape[0] < MAX_COLUMNS and 0 < x.numel() // max(k, 1) <= MAX_ROWS)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, *, block_n: int = 16, block_k: int = 128,
                num_warps: int = 8) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T (+ bias)`` for at most ``MAX_ROWS`` rows, in ``out_dtype``
    (default x's). Inputs of any float dtype are widened in registers, so
    ``skinny_gemm(x, w, out_dtype=torch.float32)`` is ``F.linear(x.float(), w.float())``
    without the two casts."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > MAX_ROWS or x.shape[-1] != k or weight.stride(-1) != 1:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} against weight {tuple(weight.shape)} "
                         f"(needs <= {MAX_ROWS} rows, K contiguous)")
    if x2.stride(-1) != 1 or (interpreting() and x2.storage_offset()):
        x2 = x2.contiguous().clone() if interpreting() else x2.contiguous()
    if interpreting():      # the interpreter mishandles views with a storage offset
        weight = weight.clone() if weight.storage_offset() else weight
        bias = bias.clone() if bias is not None and bias.storage_offset() else bias
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    opts = {} if interpreting() else {"num_warps": num_warps, "num_stages": 4}
    load_kernels(_KERNELS)._skinny_gemm_kernel[(-(-n // block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0),
        weight.stride(0), y.stride(0), M_BLOCK=next_pow2(m), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=-(-k // block_k), **opts)
    return y.reshape(*lead, n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that takes the skinny kernel on the GPU for a few rows."""
    if use_triton(x) and skinny_ok(x, weight) and weight.dtype == x.dtype:
        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)
