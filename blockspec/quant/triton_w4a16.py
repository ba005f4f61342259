"""W4A16 NVFP4 GEMM in Triton: bf16 activations x packed E2M1 weights, no dequantized copy.

One kernel serves both shapes of use:

- dense: ``y[M, N] = x[M, K] @ W^T`` with ``W`` packed [N, K/2] (+ [N, K/16] E4M3 scales and a
  0-dim global scale);
- grouped (MoE): rows of ``x`` sorted by expert, ``expert_offsets[e]:expert_offsets[e+1]`` are
  expert e's rows, weights stacked [E, N, K/2] / [E, N, K/16] / [E].

Why this shape: decode (M <= 16) is memory bound, so the kernel reads each packed byte once
(128-bit loads along K), decodes it in registers and feeds bf16 tensor-core dots.  Small N
(experts: N = 1856 or 2688) is split along K so that enough programs cover the GPU; partial sums
go to an fp32 workspace that is summed afterwards.

Decoding in registers is exact (no table): an E2M1 code ``s e1 e0 m`` placed in fp16 bits as
``s << 15 | (e1 e0 m) << 9`` is the E2M1 value times 2^-14 (subnormals included), and an E4M3
byte's low 7 bits shifted left by 7 are its value times 2^-8.  The powers of two are folded
into the global scale, so the bf16 weight tile equals ``dequantize_nvfp4(...).to(bf16)`` bit for
bit; only the fp32 summation order differs from the reference.

Triton is imported lazily (CPU CI may not have it).  ``TRITON_INTERPRET=1`` runs the kernel on
CPU tensors; the interpreter's bf16 ``tl.dot`` is broken, so there the dot runs on fp32 copies of
the same bf16 values.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from blockspec.quant.nvfp4 import GROUP_SIZE, dequantize_nvfp4

# fp16 bit trick factors: E2M1 values come out x 2^-14, E4M3 scales x 2^-8.
_SCALE_FIX = float(2 ** 22)


def triton_available() -> bool:
    """Triton importable (GPU compiler or interpreter), unless BLOCKSPEC_DISABLE_TRITON=1 asks
    for the pure-torch reference everywhere (used to compare the two paths)."""
    if os.environ.get("BLOCKSPEC_DISABLE_TRITON", "0") not in ("", "0"):
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """Build the jitted kernel (cached per mode: the interpreter decides at decoration time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _w4a16_kernel(
        x_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr,
        blk_expert_ptr, blk_row0_ptr, blk_row1_ptr,
        N, K, k_per_split,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn,
        stride_os, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        K_ITERS: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        row0 = tl.load(blk_row0_ptr + pid_b)
        row1 = tl.load(blk_row1_ptr + pid_b)
        expert = tl.load(blk_expert_ptr + pid_b).to(tl.int64)

        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row1
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        # Global scale with the two power-of-two decode factors folded in (exact).
        gscale = tl.load(ws2_ptr + expert) * 4194304.0

        HALF_K: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // 16
        jb = tl.arange(0, HALF_K)
        jg = tl.arange(0, GROUPS)
        jk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
        s_base = ws_ptr + expert * stride_se + cols[:, None].to(tl.int64) * stride_sn
        x_base = x_ptr + rows[:, None].to(tl.int64) * stride_xm

        k_start = pid_s * k_per_split
        k_end = tl.minimum(K, k_start + k_per_split)
        # Padding blocks of the grouped grid (row0 == row1) load nothing and store nothing.
        live = row0 < row1
        nmask = nmask & live
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for it in range(0, K_ITERS):
            k0 = k_start + it * BLOCK_K
            kmask_b = (k0 // 2 + jb) < (k_end // 2)
            kmask_g = (k0 // 16 + jg) < (k_end // 16)
            kmask_x = (k0 + jk) < k_end
            wb = tl.load(w_base + (k0 // 2 + jb)[None, :],
                         mask=nmask[:, None] & kmask_b[None, :], other=0).to(tl.int32)
            sb = tl.load(s_base + (k0 // 16 + jg)[None, :],
                         mask=nmask[:, None] & kmask_g[None, :], other=0).to(tl.int32)
            # E4M3 -> value * 2^-8, then one fp32 multiply per block, broadcast over its 8 bytes.
            s = ((sb & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            s = s * gscale
            s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, 8)),
                           (BLOCK_N, HALF_K))
            lo = wb & 0xF
            hi = wb >> 4
            w_lo = (((lo & 8) << 12) | ((lo & 7) << 9)).to(tl.int16)
            w_hi = (((hi & 8) << 12) | ((hi & 7) << 9)).to(tl.int16)
            w_lo = w_lo.to(tl.float16, bitcast=True).to(tl.float32) * s
            w_hi = w_hi.to(tl.float16, bitcast=True).to(tl.float32) * s
            xt = tl.load(x_base + (k0 + jk)[None, :], mask=rmask[:, None] & kmask_x[None, :],
                         other=0.0)
            if DOT_F32:
                # Interpreter only: its bf16 dot is broken and its fp32 -> bf16 cast truncates, so
                # round to nearest-even bf16 by hand and keep the (exact) values in fp32.
                b_lo = w_lo.to(tl.int32, bitcast=True)
                b_hi = w_hi.to(tl.int32, bitcast=True)
                b_x = xt.to(tl.float32).to(tl.int32, bitcast=True)
                b_lo = (b_lo + 0x7FFF + ((b_lo >> 16) & 1)) & -65536
                b_hi = (b_hi + 0x7FFF + ((b_hi >> 16) & 1)) & -65536
                b_x = (b_x + 0x7FFF + ((b_x >> 16) & 1)) & -65536
                w_lo = b_lo.to(tl.float32, bitcast=True)
                w_hi = b_hi.to(tl.float32, bitcast=True)
                xt = b_x.to(tl.float32, bitcast=True)
            else:
                w_lo = w_lo.to(tl.bfloat16)
                w_hi = w_hi.to(tl.bfloat16)
                xt = xt.to(tl.bfloat16)
            x_even, x_odd = tl.split(tl.reshape(xt, (BLOCK_M, HALF_K, 2)))
            acc += tl.dot(x_even, tl.trans(w_lo))
            acc += tl.dot(x_odd, tl.trans(w_hi))

        out = (out_ptr + pid_s * stride_os + rows[:, None].to(tl.int64) * stride_om
               + cols[None, :])
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])

    return _w4a16_kernel


def _pick_block_m(m: int) -> int:
    return 16 if m <= 16 else (32 if m <= 32 else 64)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _pick_split_k(programs: int, k: int, block_k: int, device: torch.device) -> int:
    """Split K until ~2 waves of programs cover the SMs (small-N expert shapes need it)."""
    k_blocks = -(-k // block_k)
    target = 2 * _sm_count(device)
    split = 1
    while programs * split < target and split * 2 <= k_blocks and split < 16:
        split *= 2
    return split


def _launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            ws2: torch.Tensor, blk_expert: torch.Tensor, blk_row0: torch.Tensor,
            blk_row1: torch.Tensor, num_blocks: int, block_m: int, n: int, k: int,
            out_dtype: torch.dtype, block_n: int | None, block_k: int | None,
            split_k: int | None, num_warps: int | None, num_stages: int | None) -> torch.Tensor:
    interpret = interpreting()
    kernel = _kernels(interpret)
    block_n = block_n or 64
    block_k = block_k or 128
    tiles_n = -(-n // block_n)
    split = split_k or _pick_split_k(num_blocks * tiles_n, k, block_k, x.device)
    k_per_split = -(-k // split)
    k_per_split = -(-k_per_split // block_k) * block_k
    split = -(-k // k_per_split)
    rows = x.shape[0]
    if split == 1 and not interpret:  # the interpreter's bf16 store truncates: keep fp32 there
        out = torch.empty((1, rows, n), dtype=out_dtype, device=x.device)
    else:
        out = torch.empty((split, rows, n), dtype=torch.float32, device=x.device)
    grid = (num_blocks, tiles_n, split)
    w3 = weight if weight.dim() == 3 else weight.unsqueeze(0)
    s3 = weight_scale if weight_scale.dim() == 3 else weight_scale.unsqueeze(0)
    s3 = s3.view(torch.uint8)
    extra = {}
    if not interpret:
        extra = {"num_warps": num_warps or 4, "num_stages": num_stages or 3}
    kernel[grid](
        x, w3, s3, ws2, out, blk_expert, blk_row0, blk_row1,
        n, k, k_per_split,
        x.stride(0), w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=k_per_split // block_k,
        DOT_F32=interpret, **extra,
    )
    if out.dtype == out_dtype:
        return out[0]
    return out.sum(0).to(out_dtype)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int]:
    n, half_k = weight.shape[-2], weight.shape[-1]
    k = half_k * 2
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]} but the packed weight holds K={k} "
                         f"(stored [.., {n}, {half_k}])")
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of {GROUP_SIZE}")
    if weight.dtype != torch.uint8:
        raise TypeError(f"packed weight must be uint8, got {weight.dtype}")
    if weight_scale.shape[-2:] != (n, k // GROUP_SIZE):
        raise ValueError(f"weight_scale shape {tuple(weight_scale.shape)} does not match "
                         f"[.., {n}, {k // GROUP_SIZE}]")
    return n, k


@functools.lru_cache(maxsize=256)
def _dense_blocks(m: int, block_m: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row blocks of a dense GEMM; memoized so a decode step launches no setup kernels."""
    nb = -(-m // block_m)
    row0 = torch.arange(nb, dtype=torch.int32) * block_m
    row1 = torch.clamp(row0 + block_m, max=m)
    return (torch.zeros(nb, dtype=torch.int32).to(device), row0.to(device), row1.to(device))


def w4a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
                 block_n: int | None = None, block_k: int | None = None,
                 split_k: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None) -> torch.Tensor:
    """``x[..., K] @ dequant(W)^T (+ bias)`` -> ``[..., N]`` in x's dtype, via the Triton kernel."""
    n, k = _check(x, weight, weight_scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out_dtype = x.dtype
    if m == 0:
        return x.new_empty((*lead, n))
    block_m = _pick_block_m(m)
    nb = -(-m // block_m)
    blk_expert, blk_row0, blk_row1 = _dense_blocks(m, block_m, x.device)
    ws2 = weight_scale_2.reshape(1).to(torch.float32)
    y = _launch(x2, weight.contiguous(), weight_scale.contiguous(), ws2, blk_expert, blk_row0,
                blk_row1, nb, block_m, n, k, out_dtype, block_n, block_k, split_k,
                num_warps, num_stages)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, n)


def w4a16_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           weight_scale_2: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch: exact fp32 dequant, cast to x's dtype, ``F.linear``."""
    w = dequantize_nvfp4(weight, weight_scale, weight_scale_2, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def expert_blocks(expert_offsets: torch.Tensor, rows: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Row blocks of ``block_m`` that never straddle experts, built on device without a sync.

    Returns (expert id, first row, end row) per block and the (upper-bound) block count; blocks
    past the real count have first row == end row and exit at once.
    """
    dev = expert_offsets.device
    offsets = expert_offsets.to(torch.int64)
    e = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    nblk = (counts + block_m - 1) // block_m
    cum = torch.cumsum(nblk, 0)
    upper = -(-rows // block_m) + min(e, rows)
    b = torch.arange(upper, device=dev, dtype=torch.int64)
    expert = torch.searchsorted(cum, b, right=True)
    valid = expert < e
    ex = torch.clamp(expert, max=e - 1)
    first_blk = cum[ex] - nblk[ex]
    row0 = offsets[ex] + (b - first_blk) * block_m
    row1 = torch.minimum(row0 + block_m, offsets[ex + 1])
    row0 = torch.where(valid, row0, torch.zeros_like(row0))
    row1 = torch.where(valid, row1, torch.zeros_like(row1))
    return ex.to(torch.int32), row0.to(torch.int32), row1.to(torch.int32), upper


def grouped_w4a16(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor,
                  weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
                  blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None = None,
                  block_n: int | None = None, block_k: int | None = None,
                  split_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> torch.Tensor:
    """MoE: ``x[T, K]`` sorted by expert; rows ``offsets[e]:offsets[e+1]`` use expert e.

    ``weight`` [E, N, K/2] uint8, ``weight_scale`` [E, N, K/16] E4M3, ``weight_scale_2`` [E]
    fp32.  Returns ``[T, N]`` in x's dtype.  ``blocks`` (from ``grouped_blocks``) lets the up
    and down projections of one MoE layer share the row-block table.
    """
    n, k = _check(x, weight, weight_scale)
    if weight.dim() != 3:
        raise ValueError(f"grouped weights must be [E, N, K/2], got {tuple(weight.shape)}")
    e = weight.shape[0]
    if expert_offsets.numel() != e + 1:
        raise ValueError(f"expert_offsets needs E+1={e + 1} entries, got {expert_offsets.numel()}")
    t = x.shape[0]
    if t == 0:
        return x.new_empty((0, n))
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    if blocks is None:
        blocks = grouped_blocks(expert_offsets.to(x.device), t)
    blk_expert, row0, row1, nb, block_m = blocks
    ws2 = weight_scale_2.reshape(e).to(torch.float32)
    return _launch(x2, weight.contiguous(), weight_scale.contiguous(), ws2, blk_expert, row0,
                   row1, nb, block_m, n, k, x.dtype, block_n, block_k, split_k, num_warps,
                   num_stages)


def grouped_blocks(expert_offsets: torch.Tensor, rows: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Row-block table for ``grouped_w4a16``: (expert, row0, row1, count, block_m)."""
    e = expert_offsets.numel() - 1
    block_m = _pick_block_m(max(1, rows // max(1, min(e, rows))))
    return (*expert_blocks(expert_offsets, rows, block_m), block_m)


def grouped_w4a16_reference(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor,
                            weight_scale: torch.Tensor,
                            weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Pure torch: each expert's rows through its exactly dequantized weight."""
    n = weight.shape[-2]
    out = x.new_zeros((x.shape[0], n))
    offs = [int(v) for v in expert_offsets.tolist()]
    for e in range(weight.shape[0]):
        a, b = offs[e], offs[e + 1]
        if a == b:
            continue
        w = dequantize_nvfp4(weight[e], weight_scale[e], weight_scale_2.reshape(-1)[e],
                             dtype=x.dtype)
        out[a:b] = F.linear(x[a:b], w)
    return out


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert: returns (order into ``topk_ids.flatten()``, offsets).

    ``x_sorted = x[order // top_k]``; results come back with ``y[order] = y_sorted``.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets
