"""Expert GEMVs per (token, expert) pair, for decode-sized MoE batches.

With a handful of tokens each expert sees at most a few rows, so grouping pairs by expert
(argsort, counts, offsets, gathers: a dozen launches) buys nothing: each pair's program reads
its expert's weight rows and multiplies them by one row of x. Outputs stay in pair order
(token-major), so the combine needs no permutation either. The reference is
``F.linear`` per pair (``pair_gemv_reference``); larger batches use the grouped paths.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.kernels.triton_loader import interpreting, load_kernels

_KERNELS = Path(__file__).with_name("_moe_pairs_kernels.py")


def pair_gemv_reference(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None, relu2: bool, x_per_pair: bool) -> torch.Tensor:
    """``x [T, K]`` (or ``[T*k, K]`` with ``x_per_pair``), ``ids [T, k]``, stacked ``weight
    [E, N, K]`` -> ``[T*k, N]`` in x's dtype."""
    flat = ids.reshape(-1)
    rows = x if x_per_pair else x.repeat_interleave(ids.shape[1], dim=0)
    y = torch.stack([F.linear(rows[p], weight[e], None if bias is None else bias[e])
                     for p, e in enumerate(flat.tolist())])
    return torch.square(F.relu(y)) if relu2 else y


def pair_gemv(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None = None, *, relu2: bool = False,
              x_per_pair: bool = False, block_n: int = 16, block_k: int = 128,
              num_warps: int = 8) -> torch.Tensor:
    """The fused form of ``pair_gemv_reference`` (same arguments), one launch. The default
    tile (16 columns x 128, 8 warps) was the fastest of the sweep in
    ``scripts/bench_pair_gemv.py`` on an H200 at 6 and 24 pairs of Lightning's expert shapes
    (3.5 and 4.1-4.3 TB/s; docs/benchmarks.md)."""
    pairs, k = ids.numel(), ids.shape[1]
    e, n, kdim = weight.shape
    if x.shape[-1] != kdim or weight.stride(-1) != 1:
        raise ValueError(f"pair_gemv: x [..., {x.shape[-1]}] against weight {tuple(weight.shape)} "
                         f"(needs [E, N, K={x.shape[-1]}], K contiguous)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.reshape(-1).contiguous()
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    opts = {} if interpreting() else {"num_warps": num_warps, "num_stages": 4}
    load_kernels(_KERNELS)._pair_gemv_kernel[(pairs, -(-n // block_n))](
        x, ids, weight, bias if bias is not None else weight, y, n, kdim, x.stride(0),
        weight.stride(0), weight.stride(1), y.stride(0), TOPK=k, X_PER_PAIR=x_per_pair,
        HAS_BIAS=bias is not None, RELU2=relu2, BLOCK_N=block_n, BLOCK_K=block_k,
        K_ITERS=-(-kdim // block_k), **opts)
    return y
