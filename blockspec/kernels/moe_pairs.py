"""Expert GEMVs per (token, expert) pair, for decode-sized MoE batches.

With a handful of tokens each expert sees at most a few rows, so grouping pairs by expert
(argsort, counts, offsets, gathers: a dozen launches) buys nothing: each pair's program reads
its expert's weight rows and multiplies them by one row of x. Outputs stay in pair order
(token-major), so the combine needs no permutation either. The reference is
``F.linear`` per pair (``pair_gemv_reference``); larger batches use the grouped paths.
With ``dedup=True`` pairs that share an expert (a speculative verify's few tokens often do)
read its weights once: the first pair of each expert computes all of that expert's rows
(verify is weight-read bound).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_moe_pairs_kernels.py")
# the dedup kernel's tile has a row per token: [next_pow2(tokens, 16), block_n] in fp32
DEDUP_MAX_TOKENS = 64


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
              x_per_pair: bool = False, dedup: bool = False, block_n: int | None = None,
              block_k: int = 128, num_warps: int | None = None, num_stages: int | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused form of ``pair_gemv_reference`` (same arguments), one launch. The default
    tiles are the fastest of ``scripts/bench_pair_gemv.py`` on an H200 at Lightning's expert
    shapes (docs/benchmarks.md): 16 columns x 128 on 8 warps for the plain kernel (3.5 and
    4.1-4.3 TB/s at 6 and 24 pairs), 32 x 128 on 4 warps for ``dedup`` (as fast as the plain
    kernel when 24-36 pairs touch 23-32 experts, 1.2-2.4x faster when they share experts).

    ``dedup`` reads each distinct expert's weights once per call, for up to
    ``DEDUP_MAX_TOKENS`` tokens: the first pair of an expert computes the rows of all its
    pairs (at most one per token under top-k routing) with one ``tl.dot`` per K block; the
    other pairs' programs return at once. 16-bit weights take a 16-bit dot with fp32
    accumulation; fp32 weights (or x of another dtype) an fp32 IEEE dot, as does the
    interpreter. ``out`` ([pairs, N], x's dtype) receives the result when given."""
    pairs, (tokens, k) = ids.numel(), ids.shape
    e, n, kdim = weight.shape
    if x.shape[-1] != kdim or weight.stride(-1) != 1:
        raise ValueError(f"pair_gemv: x [..., {x.shape[-1]}] against weight {tuple(weight.shape)} "
                         f"(needs [E, N, K={x.shape[-1]}], K contiguous)")
    if dedup and tokens > DEDUP_MAX_TOKENS:
        raise ValueError(f"pair_gemv: dedup takes at most {DEDUP_MAX_TOKENS} tokens, "
                         f"got {tokens}")
    block_n = block_n or (32 if dedup else 16)
    num_warps = num_warps or (4 if dedup else 8)
    if dedup and min(block_n, block_k) < 16:
        raise ValueError(f"pair_gemv: dedup needs block_n, block_k >= 16 (tl.dot), "
                         f"got {block_n}, {block_k}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.reshape(-1).contiguous()
    if out is None:
        out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    elif out.shape != (pairs, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"pair_gemv: out {tuple(out.shape)} {out.dtype}, wanted "
                         f"({pairs}, {n}) {x.dtype} with contiguous rows")
    grid = (pairs, -(-n // block_n))
    args = (x, ids, weight, bias if bias is not None else weight, out)
    flags = dict(TOPK=k, X_PER_PAIR=x_per_pair, HAS_BIAS=bias is not None, RELU2=relu2,
                 BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=-(-kdim // block_k))
    strides = (x.stride(0), weight.stride(0), weight.stride(1), out.stride(0))
    kernels = load_kernels(_KERNELS)
    if not dedup:
        opts = {} if interpreting() else {"num_warps": num_warps, "num_stages": num_stages or 4}
        kernels._pair_gemv_kernel[grid](*args, n, kdim, *strides, **flags, **opts)
        return out
    dot_f32 = (interpreting() or weight.dtype not in (torch.bfloat16, torch.float16)
               or x.dtype != weight.dtype)
    # fp32 tiles are twice the shared memory per stage
    stages = num_stages or (2 if dot_f32 else 4)
    opts = {} if interpreting() else {"num_warps": num_warps, "num_stages": stages}
    kernels._pair_gemv_dedup_kernel[grid](*args, tokens, n, kdim, *strides, DOT_F32=dot_f32,
                                          T_BLOCK=next_pow2(tokens, 16), **flags, **opts)
    return out
