"""The MoE router logits ``[T, E] fp32 = float(x) @ weight.T`` in one launch.

``F.linear(x.float(), w)`` costs three or four kernels per MoE layer on a GPU: a copy widening
the bf16 activations to fp32, then a cuBLAS GEMV (dot + reduce) at T=1 or a CUTLASS SIMT sgemm
with a split-K reduce at speculative-verify sizes (~9.5 us at T=6 on an H200). Here one kernel
reads x in its own dtype, widens it in registers, and accumulates in fp32, with the 1.4 MB fp32
weight read spread over many programs (a few experts x a block of tokens x a K split each).

At decode and verify sizes the K dimension is split across programs (``router_partials``:
``[S, T, E]`` partial sums, S = 3 at Lightning's H = 2688), so every program issues its loads
once and waits one memory round trip instead of S in a row; the routing kernel sums the S
partials in index order as it reads them, so there is no reduce launch and the result is
deterministic (``sum_partials`` adds them in the same order, for the tests).

At prefill sizes (``GEMM_MIN_TOKENS`` tokens or more) the GEMV's re-reading of the weight for
every block of 16 tokens on the CUDA cores loses to a cuBLAS fp32 GEMM (3.7 TFLOP/s against
tens in a 2048-token chunk), so ``router_partials`` hands those to ``F.linear`` as one split.
``router_logits_reference`` is the torch code, kept for the tests and for the CPU.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2, sm_count

_KERNELS = Path(__file__).with_name("_router_gemv_kernels.py")
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TILE = 8192          # elements of the per-program [BLOCK_T, BLOCK_E, BLOCK_K] product tile
_MAX_BLOCK_T = 16
_MAX_BLOCK_E = 8
_MAX_BLOCK_K = 1024
_PROGRAMS_PER_SM = 3  # K splits stop before the grid passes this many programs per SM
GEMM_MIN_TOKENS = 128  # from here on a cuBLAS fp32 GEMM (prefill chunks, verifies of 32+ x 4+ rows)


def router_logits_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight)


def _blocks(t: int, e: int, h: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K). Tokens in blocks of up to 16 (each weight element is read
    once per token block); experts in the largest block (up to 8) that still leaves at least
    one program per SM, so the weight read spreads over the whole GPU (T=1 on an H200: one
    expert per program, 128 programs reading ~10.5 KB each); the K chunk makes the
    [BLOCK_T, BLOCK_E, BLOCK_K] product tile at most _TILE elements (32 fp32 registers a
    thread at 8 warps), so a verify's few tokens take 3 K chunks at H = 2688, not 6: the
    chunks run one after another and each waits a memory round trip (H200, T = 6: 6.9 us a
    call with 4096-element tiles, against 2.5 us at T = 1). ``blocks=`` overrides it."""
    block_t = min(next_pow2(t), _MAX_BLOCK_T)
    tiles_t = -(-t // block_t)
    block_e = 1
    while block_e < _MAX_BLOCK_E and -(-e // (2 * block_e)) * tiles_t >= sms:
        block_e *= 2
    block_k = min(max(_TILE // (block_t * block_e), 32), _MAX_BLOCK_K, next_pow2(h, 16))
    return block_t, block_e, block_k


def _splits(programs: int, chunks: int, sms: int) -> int:
    """K splits for a grid of ``programs`` (expert x token blocks) over ``chunks`` K chunks: as
    many as keep the grid within ``_PROGRAMS_PER_SM`` programs per SM (one wave of small
    programs), at most one per chunk. Lightning on an H200 (132 SMs): 128 programs and 3
    chunks of 1024 at T <= 8 -> 3 splits, 384 programs of one chunk each; T = 64 -> none."""
    return max(1, min(chunks, _PROGRAMS_PER_SM * sms // max(programs, 1)))


def _shape(a) -> object:
    return tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D [E, H] tensor, got {_shape(weight)}")
    if weight.dtype != torch.float32:
        raise ValueError(f"weight must be float32, got {weight.dtype}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()} "
                         f"for shape {tuple(weight.shape)}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [T, H] tensor, got {_shape(x)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [T, H] with H = weight.shape[1] = {weight.shape[1]}, "
                         f"got {tuple(x.shape)}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be one of {', '.join(map(str, _X_DTYPES))}, got {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x must be on weight's device {weight.device}, got {x.device}")


def router_partials(x: torch.Tensor, weight: torch.Tensor, *,
                    blocks: tuple[int, int, int] | None = None,
                    splits: int | None = None) -> torch.Tensor:
    """``x [T, H]`` (any float dtype) times ``weight [E, H]`` (fp32, contiguous) transposed, as
    ``[S, T, E]`` fp32 partial sums over S consecutive ranges of H: their sum in index order
    is the router logits (equal to ``router_logits_reference`` within fp32 rounding, since
    the sums run in another order). ``blocks`` = (BLOCK_T, BLOCK_E, BLOCK_K), powers of two,
    and ``splits`` override the tile and split choice (for tuning and tests); without them,
    ``GEMM_MIN_TOKENS`` tokens or more are one cuBLAS GEMM (S = 1)."""
    _check(x, weight)
    t, h = x.shape
    e = weight.shape[0]
    if blocks is not None and any(b < 1 or b & (b - 1) for b in blocks):
        raise ValueError(f"blocks must be powers of two, got {blocks}")
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if t == 0 or e == 0 or h == 0:
        return torch.zeros(1, t, e, dtype=torch.float32, device=x.device)
    if blocks is None and splits is None and t >= GEMM_MIN_TOKENS:
        return router_logits_reference(x, weight)[None]
    sms = sm_count(x.device, cpu=8)
    block_t, block_e, block_k = blocks or _blocks(t, e, h, sms)
    chunks = -(-h // block_k)
    if splits is None:
        splits = _splits(-(-e // block_e) * -(-t // block_t), chunks, sms)
    splits = min(splits, chunks)
    out = torch.empty(splits, t, e, dtype=torch.float32, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if interpreting():
        x = x.clone() if x.storage_offset() else x
        weight = weight.clone() if weight.storage_offset() else weight
    k_iters = -(-chunks // splits)
    grid = (-(-e // block_e), -(-t // block_t), splits)
    load_kernels(_KERNELS)._router_gemv_kernel[grid](
        x, weight, out, t, e, h, x.stride(0), out.stride(1), out.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, K_ITERS=k_iters,
        **({} if interpreting() else
           {"num_warps": 8 if block_t * block_e * block_k > 4096 else 4}))
    return out


def sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """``[S, T, E]`` -> ``[T, E]``, adding the splits in index order (as the routing kernel
    does), so the same partials always give the same logits."""
    out = partials[0]
    for p in partials[1:]:
        out = out + p
    return out
