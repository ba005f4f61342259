"""W4A16 NVFP4 GEMM in Triton: bf16 activations x packed E2M1 weights, no dequantized copy.

One kernel serves every shape of use:

- dense: ``y[M, N] = x[M, K] @ W^T`` with ``W`` packed [N, K/2] (+ [N, K/16] E4M3 scales and a
  0-dim global scale);
- grouped (MoE): rows of ``x`` sorted by expert, ``expert_offsets[e]:expert_offsets[e+1]`` are
  expert e's rows, weights stacked [E, N, K/2] / [E, N, K/16] / [E];
- pairs (MoE at decode): one block per (token, expert) pair, no sort (``pair_w4a16``).

Packed weights come in the kernel's layout (``w4a16_layout.to_kernel_layout``: the checkpoint's
bits moved within each 16-bit word; shapes, K order and scales unchanged). Every function here,
the ``_reference`` ones included, takes that layout; ``NVFP4Linear`` and the MoE's stacked
experts convert once after loading.

Why this shape: decode (M <= 16) is memory bound, so the kernel reads each packed byte once,
decodes it in registers and feeds bf16 tensor-core dots. W is read as uint16 words of 4 nibbles
(K order 4i..4i+3), so a K block is 4 dots over "nibble streams" r = 0..3, and x as int64 words
(4 bf16) split the same way: a dot's K order is free as long as x and W agree. Weights, x and
(as int32 words) scales are staged by cp.async; Triton converts the *packed* words to the MMA
operand layout and each thread decodes whole 16-weight scale groups in registers.

The decode is exact: code ``s e1 e0 m`` as bf16 bits ``s << 15 | (e1 e0 m) << 6`` is
E2M1 * 2^-126 (subnormal included); the block scale becomes bf16 ``scale * 2^118`` (exact, via
fp16 and fp32); their bf16 product is E2M1 * scale * 2^-8 exactly (<= 6 significant bits); and
``weight_scale_2 * 2^8`` scales the fp32 accumulator at the end. The MMA thus sees exact
E2M1 * E4M3 products (more precise than the reference, which rounds the scaled weight to bf16).
Inline PTX does the bit work: the kernel layout lets 9 integer ops and 4 bf16x2 multiplies make
8 weights (the K loop of a verify's MoE call: 3.3 SASS instructions per weight, against 3.8
with the checkpoint's nibbles; ``scripts/sass_w4a16.py``). M <= 16 uses mma with the weights as
B; larger M swaps to ``W @ x^T`` so wgmma reads x from shared memory (``v2_default_config``).
Small N (experts: N = 1856 or 2688) is split along K so that enough programs cover the GPU;
the last CTA of each tile sums the partials (per-stream tile counters that it resets), so a
call is one launch.

Variants (``variant=`` or ``BLOCKSPEC_W4A16_VARIANT``; ``default_variant()`` is ``v2``): ``v2``
as above, ``v2w`` always swapped (wgmma), ``v2t`` the same bits built by Triton ops instead of
PTX (comparisons).

At decode a call moves only a few MB, so its time is set by the launch config, not by
bandwidth: v2 takes the tile, split-K, warps and stages of the call's problem class from
``w4a16_tuned.json`` (``tuned_config``; filled by scripts/bench_w4a16_decode.py) where it has
an entry, else the built-in defaults; explicit keyword arguments override both.

Triton is imported lazily (CPU CI may not have it). Under ``TRITON_INTERPRET=1`` (CPU tensors)
every variant runs the same kernel with the decode in fp32 (the interpreter's bf16 dot and
casts are unreliable): the same exact products.
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.kernels.triton_loader import interpreting, sm_count
from blockspec.quant.nvfp4 import GROUP_SIZE, dequantize_nvfp4
from blockspec.quant.w4a16_layout import from_kernel_layout

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


# DECODE values of the v2 kernel: pure-Triton bf16 decode, inline-PTX bf16 decode, fp32 decode
# (the interpreter, whose bf16 dot and casts are unreliable).
_DEC_TRITON, _DEC_ASM, _DEC_FP32 = 0, 1, 2


@functools.lru_cache(maxsize=None)
def _kernels_v2(interpret: bool):
    """Build the v2 kernel (see the module docstring); cached per mode (the interpreter decides
    at decoration time).

    Self-contained on purpose (literal constants, no helper functions): the interpreter re-runs
    the kernel's source against module globals only, so closures would not resolve there.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _w4a16_min_fn(a, b):
        return tl.minimum(a, b)

    # The kernel's one helper lives in the module's globals (the interpreter resolves names
    # there, not in this closure).
    globals()["_w4a16_min_fn"] = _w4a16_min_fn

    @triton.jit
    def _w4a16_v2_kernel(
        x_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr, part_ptr, cnt_ptr,
        blk_expert_ptr, blk_row0_ptr, blk_row1_ptr,
        M, N, K, k_per_split, num_tiles,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SLICES: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr, DECODE: tl.constexpr,
        GROUPED: tl.constexpr,
        EVEN_N: tl.constexpr, MASK_K: tl.constexpr, SCALE_WORDS: tl.constexpr,
        K_ITERS: tl.constexpr, PAIRS: tl.constexpr = 0, TOPK: tl.constexpr = 1,
        X_PER_PAIR: tl.constexpr = False, DEDUP: tl.constexpr = False,
        RELU2: tl.constexpr = False, DISTINCT: tl.constexpr = False, SHARED: tl.constexpr = 0,
        SHARED_BASE: tl.constexpr = 0,
    ):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        lanes = tl.arange(0, BLOCK_M)
        if PAIRS:  # block = (token, expert) pair p of ids [M tokens, TOPK] (blk_expert_ptr)
            # With SHARED = S > 0 the stack ends in S pseudo-experts (from SHARED_BASE on: the
            # shared expert's slices), which every token uses: output rows P + t * S + s after
            # the P = M * TOPK routed pairs; blocks past P are theirs (one per row, or one per
            # pseudo-expert for all tokens under DEDUP).
            n_pairs = M * TOPK
            pc = tl.minimum(pid_b, n_pairs - 1)
            e32 = tl.load(blk_expert_ptr + pc)
            if DEDUP:
                # Pairs are keyed by (expert, how often it came earlier in the same token: 0
                # under top-k routing, which DISTINCT promises), so a key has at most one pair
                # per token; lane t of the tile is token t's pair of p's key.  Only the key's
                # first pair (the leader) runs: it reads the expert once for all its tokens.
                occ_p = pid_b * 0
                if not DISTINCT:
                    for jj in tl.static_range(TOPK):
                        same = tl.load(blk_expert_ptr + (pc // TOPK) * TOPK + jj) == e32
                        occ_p += (same & (jj < pc % TOPK)).to(tl.int32)
                tm = lanes < M
                first = tl.full([BLOCK_M], 1 << 30, tl.int32)
                for jj in tl.static_range(TOPK):
                    col = tl.load(blk_expert_ptr + lanes * TOPK + jj, mask=tm, other=-1)
                    occ = lanes * 0
                    if not DISTINCT:
                        for j2 in tl.static_range(jj):
                            occ += (tl.load(blk_expert_ptr + lanes * TOPK + j2, mask=tm,
                                            other=-1) == col).to(tl.int32)
                    first = tl.where(tm & (col == e32) & (occ == occ_p) & (first == 1 << 30),
                                     lanes * TOPK + jj, first)
                lead = tl.reduce(first, 0, _w4a16_min_fn) == pid_b
                if SHARED:
                    lead = lead | (pid_b >= n_pairs)
                if not lead:
                    return
                rmask = first < (1 << 30)
                out_rows = first
                if SHARED:
                    is_sh = pid_b >= n_pairs
                    e32 = tl.where(is_sh, SHARED_BASE + pid_b - n_pairs, e32)
                    out_rows = tl.where(is_sh, n_pairs + lanes * SHARED + pid_b - n_pairs,
                                        out_rows)
                    rmask = tl.where(is_sh, tm, rmask)
                x_rows = out_rows if X_PER_PAIR else lanes
            else:  # one row: lane 0 = the pair's own
                rmask = lanes == 0
                out_rows = pid_b + lanes * 0
                x_rows = out_rows if X_PER_PAIR else out_rows // TOPK
                if SHARED:
                    is_sh = pid_b >= n_pairs
                    q = tl.maximum(pid_b - n_pairs, 0)
                    e32 = tl.where(is_sh, SHARED_BASE + q % SHARED, e32)
                    if not X_PER_PAIR:
                        x_rows = tl.where(is_sh, q // SHARED + lanes * 0, x_rows)
            expert = e32.to(tl.int64)
        elif GROUPED:  # row-block table (issued together: one round trip before the weights)
            row0 = tl.load(blk_row0_ptr + pid_b)
            row1 = tl.load(blk_row1_ptr + pid_b)
            expert = tl.load(blk_expert_ptr + pid_b).to(tl.int64)
            if row0 >= row1:  # padding block of the grouped grid
                return
            out_rows = row0 + lanes
            rmask = out_rows < row1
            x_rows = out_rows
        else:  # dense: no table to wait for
            out_rows = pid_b * BLOCK_M + lanes
            rmask = out_rows < M
            x_rows = out_rows
            expert = 0
        # weight_scale_2, times the 2^8 that the exact decode below leaves out.
        gscale = tl.load(ws2_ptr + expert) * 256.0

        QK: tl.constexpr = BLOCK_K // 4       # uint16 words of W (int64 words of x) per slice
        GROUPS: tl.constexpr = BLOCK_K // 16  # scale bytes per slice
        # Scales are read as int32 words (4 bytes) when rows allow it: a 4-byte load per thread
        # is what lets Triton's pipeliner stage it with cp.async like the weights, instead of
        # waiting a full memory round trip for the scale bytes in every iteration (lm_head:
        # 102 -> 81 us on an H200).  Only for BLOCK_K >= 128: with one word per row the
        # byte shuffle costs more shared-memory round trips than it saves.
        GS: tl.constexpr = GROUPS // 4 if SCALE_WORDS else GROUPS
        CHUNK: tl.constexpr = BLOCK_K * SLICES
        RANK3: tl.constexpr = SLICES > 1      # slices of K side by side: a batched dot
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        jq = tl.arange(0, QK)
        jg = tl.arange(0, GS)
        w_base = (w_ptr + expert * stride_we).to(tl.pointer_type(tl.uint16))
        s_base = ws_ptr + expert * stride_se
        if SCALE_WORDS:
            s_base = s_base.to(tl.pointer_type(tl.int32))
            stride_sn = stride_sn // 4
        x_base = x_ptr.to(tl.pointer_type(tl.int64))
        cols64 = cols.to(tl.int64)
        rows64 = x_rows.to(tl.int64)
        if RANK3:
            js = tl.arange(0, SLICES)
            kq = (js * QK)[:, None, None] + jq[None, None, :]
            kg = (js * GS)[:, None, None] + jg[None, None, :]
            w_ptrs = w_base + cols64[None, :, None] * (stride_wn // 2) + kq
            s_ptrs = s_base + cols64[None, :, None] * stride_sn + kg
            x_ptrs = x_base + rows64[None, :, None] * (stride_xm // 4) + kq
            wmask = nmask[None, :, None]
            xmask = rmask[None, :, None]
            acc = tl.full((SLICES, BLOCK_M, BLOCK_N), 0.0, tl.float32)
        else:
            kq = jq[None, :]
            kg = jg[None, :]
            w_ptrs = w_base + cols64[:, None] * (stride_wn // 2) + kq
            s_ptrs = s_base + cols64[:, None] * stride_sn + kg
            x_ptrs = x_base + rows64[:, None] * (stride_xm // 4) + kq
            wmask = nmask[:, None]
            xmask = rmask[:, None]
            if SWAP:
                acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
            else:
                acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)

        k_start = tl.multiple_of(pid_s * k_per_split, 64)
        k_len = tl.minimum(K, k_start + k_per_split) - k_start
        w_ptrs += k_start // 4
        s_ptrs += k_start // 16 // (4 if SCALE_WORDS else 1)
        x_ptrs += k_start // 4
        # (The interpreter's range() needs a Python int: K_ITERS, with MASK_K for the rest.)
        for it in range(0, K_ITERS if DECODE == 2 else (k_len + CHUNK - 1) // CHUNK):
            if MASK_K:  # K is not a multiple of the chunk (odd shapes only)
                k_left = k_len - it * CHUNK
                wq = tl.load(w_ptrs, mask=wmask & (kq < k_left // 4), other=0)
                sb = tl.load(s_ptrs, mask=wmask & (kg < k_left // (64 if SCALE_WORDS else 16)),
                             other=0)
                xq = tl.load(x_ptrs, mask=xmask & (kq < k_left // 4), other=0)
            elif EVEN_N:  # no weight mask at all, so the loads vectorize
                wq = tl.load(w_ptrs)
                sb = tl.load(s_ptrs)
                xq = tl.load(x_ptrs, mask=xmask, other=0)
            else:
                wq = tl.load(w_ptrs, mask=wmask, other=0)
                sb = tl.load(s_ptrs, mask=wmask, other=0)
                xq = tl.load(x_ptrs, mask=xmask, other=0)
            w_ptrs += CHUNK // 4
            s_ptrs += CHUNK // (64 if SCALE_WORDS else 16)
            x_ptrs += CHUNK // 4
            if SCALE_WORDS:  # bytes of each word, in order: join/reshape stay in registers
                sb = tl.join(tl.join(sb & 0xFF, (sb >> 16) & 0xFF),
                             tl.join((sb >> 8) & 0xFF, (sb >> 24) & 0xFF))
                if RANK3:
                    sb = tl.reshape(sb, (SLICES, BLOCK_N, GROUPS))
                else:
                    sb = tl.reshape(sb, (BLOCK_N, GROUPS))
            # Each scale covers 4 words (16 weights): broadcast in registers, no reshuffle.
            if RANK3:
                sb = tl.reshape(tl.broadcast_to(sb[:, :, :, None], (SLICES, BLOCK_N, GROUPS, 4)),
                                (SLICES, BLOCK_N, QK))
            else:
                sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_N, GROUPS, 4)),
                                (BLOCK_N, QK))
            # E4M3 -> fp16 bits = scale * 2^-8 (exact), then * 2^126 -> scale * 2^118.
            sf = ((sb.to(tl.int32) & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True)
            sf = sf.to(tl.float32) * 8.507059173023462e+37
            if DECODE == 1:
                # Per register of two words (lane 0 = word 2p, lane 1 = word 2p+1): stream r
                # -> bf16 bits sign << 15 | magnitude << 6 (E2M1 * 2^-126), times the scale
                # pair.  The layout puts stream r's 4 bits where one shift (stream 0: << 2,
                # 1: << 6), a byte swap and a shift (2: << 4) or a masked merge of the word
                # and its byte swap (3) lands them: 9 integer ops per 8 weights.
                # Registers: outputs $0..$7 (stream r: $2r, $2r+1), words $8 $9, scales $10 $11.
                w0, w1, w2, w3 = tl.inline_asm_elementwise(
                    "{\n.reg .b32 a, b, c, d, e;\n"
                    "shl.b32 a, $8, 2; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $0, a, $10;\n"
                    "shl.b32 a, $9, 2; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $1, a, $11;\n"
                    "shl.b32 a, $8, 6; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $2, a, $10;\n"
                    "shl.b32 a, $9, 6; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $3, a, $11;\n"
                    "prmt.b32 b, $8, 0, 0x2301; prmt.b32 c, $9, 0, 0x2301;\n"
                    "shl.b32 a, b, 4; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $4, a, $10;\n"
                    "shl.b32 a, c, 4; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $5, a, $11;\n"
                    "and.b32 a, $8, 0x81808180; and.b32 d, b, 0x00400040; or.b32 a, a, d;\n"
                    "mul.rn.bf16x2 $6, a, $10;\n"
                    "and.b32 a, $9, 0x81808180; and.b32 e, c, 0x00400040; or.b32 a, a, e;\n"
                    "mul.rn.bf16x2 $7, a, $11;\n}",
                    "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [wq, sf.to(tl.bfloat16)],
                    dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True,
                    pack=4)
            else:  # the same bits by Triton ops: bf16 (v2t) or fp32 (the interpreter)
                q = wq.to(tl.int32)
                sw = ((q >> 8) | (q << 8)) & 0xFFFF
                b0 = (q << 2) & 0x81C0
                b1 = (q << 6) & 0x81C0
                b2 = (sw << 4) & 0x81C0
                b3 = (q & 0x8180) | (sw & 0x0040)
                if DECODE == 0:
                    s = sf.to(tl.bfloat16)
                    w0 = b0.to(tl.int16).to(tl.bfloat16, bitcast=True) * s
                    w1 = b1.to(tl.int16).to(tl.bfloat16, bitcast=True) * s
                    w2 = b2.to(tl.int16).to(tl.bfloat16, bitcast=True) * s
                    w3 = b3.to(tl.int16).to(tl.bfloat16, bitcast=True) * s
                else:  # bf16 bits << 16 are the same value as fp32 bits
                    w0 = (b0 << 16).to(tl.float32, bitcast=True) * sf
                    w1 = (b1 << 16).to(tl.float32, bitcast=True) * sf
                    w2 = (b2 << 16).to(tl.float32, bitcast=True) * sf
                    w3 = (b3 << 16).to(tl.float32, bitcast=True) * sf
            # x element 4i + r of each int64 word: the same K order as weight stream r.
            if DECODE == 2:
                x0 = ((xq & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
                x1 = (((xq >> 16) & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
                x2 = (((xq >> 32) & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
                x3 = (((xq >> 48) & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
            else:
                x0 = (xq & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
                x1 = ((xq >> 16) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
                x2 = ((xq >> 32) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
                x3 = ((xq >> 48) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
            if RANK3:
                acc = tl.dot(x0, tl.permute(w0, (0, 2, 1)), acc)
                acc = tl.dot(x1, tl.permute(w1, (0, 2, 1)), acc)
                acc = tl.dot(x2, tl.permute(w2, (0, 2, 1)), acc)
                acc = tl.dot(x3, tl.permute(w3, (0, 2, 1)), acc)
            elif SWAP:  # acc^T = W x^T: W from registers, x from shared memory (wgmma)
                acc = tl.dot(w0, tl.trans(x0), acc)
                acc = tl.dot(w1, tl.trans(x1), acc)
                acc = tl.dot(w2, tl.trans(x2), acc)
                acc = tl.dot(w3, tl.trans(x3), acc)
            else:
                acc = tl.dot(x0, tl.trans(w0), acc)
                acc = tl.dot(x1, tl.trans(w1), acc)
                acc = tl.dot(x2, tl.trans(w2), acc)
                acc = tl.dot(x3, tl.trans(w3), acc)
        if RANK3:  # sum the K slices (split/reshape rather than tl.sum, which the
            # interpreter cannot run when TRITON_INTERPRET is set after triton's import)
            acc = tl.permute(acc, (1, 2, 0))
            if SLICES == 4:
                a, b = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2, 2)))
                acc = a + b
            a, b = tl.split(acc)
            acc = a + b
        if SWAP:
            acc = tl.trans(acc)

        out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        omask = rmask[:, None] & nmask[None, :]
        if SPLIT == 1:
            y = (acc * gscale).to(out_ptr.dtype.element_ty)
            if RELU2:  # relu(.)^2 of the rounded value, as relu2(linear(x)) computes it
                yf = tl.maximum(y.to(tl.float32), 0.0)
                y = (yf * yf).to(out_ptr.dtype.element_ty)
            tl.store(out_ptrs, y, mask=omask)
        else:
            # Split-K: park the fp32 partial; the last CTA of the tile sums all of them, so
            # no second kernel is needed.  fence.acq_rel.gpu in every thread (a replicated
            # one-element tensor runs the asm in all of them) plus the barrier order the
            # partials against the counter, as __threadfence() + __syncthreads() would.
            tile = pid_b * tl.num_programs(1) + pid_n
            offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            part = part_ptr + tile.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs
            tl.store(part + pid_s.to(tl.int64) * num_tiles * (BLOCK_M * BLOCK_N), acc)
            if DECODE != 2:
                tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.u32 $0, 0;", "=r,r",
                                          [tl.full([1], 0, tl.int32)], dtype=tl.int32,
                                          is_pure=False, pack=1)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + tile, 1)
            if done == SPLIT - 1:
                if DECODE != 2:
                    tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.u32 $0, 0;", "=r,r",
                                              [tl.full([1], 0, tl.int32)], dtype=tl.int32,
                                              is_pure=False, pack=1)
                total = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
                for sp in range(0, SPLIT):  # not unrolled: SPLIT tiles in flight would spill
                    total += tl.load(part + sp * num_tiles * (BLOCK_M * BLOCK_N),
                                     cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + tile, 0)
                y = (total * gscale).to(out_ptr.dtype.element_ty)
                if RELU2:
                    yf = tl.maximum(y.to(tl.float32), 0.0)
                    y = (yf * yf).to(out_ptr.dtype.element_ty)
                tl.store(out_ptrs, y, mask=omask)

    return _w4a16_v2_kernel


def _pick_block_m(m: int) -> int:
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def _pick_split_k(programs: int, k: int, block_k: int, sms: int, waves: float = 2.0) -> int:
    """Split K until ~``waves`` waves of programs cover the ``sms`` SMs (small-N expert shapes
    need it).  v2 asks for 1.5: each split adds a partial-sum round trip (best on an H200
    sweep).  Takes the SM count rather than a device so the decode sweep can plan splits
    without one."""
    k_blocks = -(-k // block_k)
    target = waves * sms
    split = 1
    while programs * split < target and split * 2 <= k_blocks and split < 16:
        split *= 2
    return split


# Tile-counter buffers of the in-kernel split-K reduction, per (device, stream): every CTA that
# finishes a tile bumps its counter and the last one resets it, so they stay zero between
# launches; one buffer per stream keeps concurrent streams from sharing counters.  Allocate
# them (run once) before capturing a CUDA graph, like the row-block tables.
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    buf = _COUNTERS.get((device, stream))
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[(device, stream)] = buf
    return buf


def split_plan(k: int, chunk: int, split: int) -> tuple[int, int]:
    """(splits launched, K per split) for ``split`` asked-for splits of K: each split covers
    whole ``chunk``s of K, so a large request can come out smaller (the sweep uses this to
    skip splits that would launch the same kernel twice)."""
    k_per_split = -(-k // split)
    k_per_split = -(-k_per_split // chunk) * chunk
    return -(-k // k_per_split), k_per_split


def check_v2_tile(block_n: int, block_k: int, k_slices: int) -> None:
    """Raise ValueError for a tile the v2 kernel cannot run: ``tl.arange`` needs powers of
    two, the x/W words need ``block_k % 64 == 0``, the batched dot ``k_slices`` in 1, 2, 4."""
    ok = (block_n >= 16 and block_n & (block_n - 1) == 0 and block_k >= 64
          and block_k & (block_k - 1) == 0 and k_slices in (1, 2, 4))
    if not ok:
        raise ValueError(f"v2 needs block_k a power of two >= 64, block_n a power of two >= 16 "
                         f"and k_slices in (1, 2, 4) (got {block_k}, {block_n}, {k_slices})")


def _builtin_v2_config(n: int, k: int, m: int) -> dict:
    """Tile shape of the v2 kernels when neither the caller nor the tuned table names one (best
    of an older H200 sweep, at shapes other than decode's).

    M <= 16 (decode): mma with the weights as B; wide N (lm_head) takes 128-row tiles on
    2 warps, narrow N (experts) 64-row tiles plus split-K (``_pick_split_k``, ~1.5 waves).
    Larger M: the swapped wgmma form (``swap``), 32-row blocks of x for narrow N, 256-row
    tiles of 64-wide K blocks on 8 warps for wide N.  Otherwise the K block is the widest
    that divides K (a ragged K takes the slower masked path).
    """
    wide = n >= 8192
    cfg = {"block_m": 16 if m <= 16 else (32 if m <= 32 or not wide else 64),
           "block_n": 128 if wide else 64, "block_k": 128 if k % 128 == 0 else 64,
           "k_slices": 1, "swap": m > 16, "num_warps": 2 if wide else 4, "num_stages": 3,
           "split_k": None, "maxnreg": None}
    if m > 16 and wide:
        cfg.update(block_n=256, block_k=64, num_warps=8)
    return cfg


# ------------------------------------------------------------------------- tuned configs
# Decode calls move only a few MB each, so their time is set by the launch config (tile,
# split-K, warps, stages) rather than by bandwidth; the best config differs per problem class,
# so an H200 sweep (scripts/bench_w4a16_decode.py --write-table) stores one per class here.
TUNED_PATH = Path(__file__).with_name("w4a16_tuned.json")
TUNED_ENV = "BLOCKSPEC_W4A16_TUNED"  # another table's path, or "none" for built-ins only
TUNED_KEYS = ("block_n", "block_k", "k_slices", "split_k", "num_warps", "num_stages", "maxnreg")
# Upper edges of the row buckets (dense: rows of x) and of the block-count buckets (grouped:
# row blocks in the table, one per (token, expert) pair at decode); doubling past the last.
ROW_EDGES = (1, 4, 8, 16, 32, 64)
BLOCK_EDGES = (8, 32, 64)
_KEY_RE = {"dense": re.compile(r"dense N=\d+ K=\d+ rows=(\d+(?:-\d+)?)"),
           "grouped": re.compile(r"grouped N=\d+ K=\d+ block_m=\d+ blocks=(\d+(?:-\d+)?)")}


class TunedTableError(ValueError):
    """The tuned-config table is unreadable or one of its entries is malformed."""


def bucket(value: int, edges: tuple[int, ...]) -> str:
    """Label of the bucket holding ``value`` (>= 1): ``"lo-hi"``, or ``"n"`` for one value."""
    lo, hi, i = 1, edges[0], 0
    while value > hi:
        i += 1
        lo, hi = hi + 1, edges[i] if i < len(edges) else hi * 2
    return str(lo) if lo == hi else f"{lo}-{hi}"


def problem_key(n: int, k: int, m: int, blocks: int | None = None) -> str:
    """Table key of a v2 call: dense by the rows ``m`` of x, grouped (``blocks`` given) by its
    rows per block ``m`` and the bucket of its row-block count."""
    if blocks is None:
        return f"dense N={n} K={k} rows={bucket(m, ROW_EDGES)}"
    return f"grouped N={n} K={k} block_m={m} blocks={bucket(blocks, BLOCK_EDGES)}"


def _check_key(key: str) -> None:
    kind = key.split(" ", 1)[0]
    match = _KEY_RE[kind].fullmatch(key) if kind in _KEY_RE else None
    if match is None:
        raise ValueError("expected 'dense N=<n> K=<k> rows=<bucket>' or "
                         "'grouped N=<n> K=<k> block_m=<m> blocks=<bucket>'")
    label = match.group(1)
    want = bucket(int(label.split("-")[0]), ROW_EDGES if kind == "dense" else BLOCK_EDGES)
    if label != want:  # a key no call can produce would silently never match
        raise ValueError(f"bucket {label!r} is not one of the buckets (the one holding "
                         f"{label.split('-')[0]} is {want!r})")


def _check_entry(cfg: object) -> dict:
    if not isinstance(cfg, dict):
        raise ValueError(f"expected an object of {TUNED_KEYS}, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(TUNED_KEYS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; allowed: {TUNED_KEYS}")
    for name, value in cfg.items():
        if value is None and name in ("split_k", "maxnreg"):  # auto / the compiler's choice
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if cfg.get("maxnreg") is not None and not 24 <= cfg["maxnreg"] <= 255:
        raise ValueError(f"maxnreg must be in [24, 255] (registers per thread), got "
                         f"{cfg['maxnreg']}")
    warps = cfg.get("num_warps", 4)
    if warps & (warps - 1) or warps > 32:
        raise ValueError(f"num_warps must be a power of two <= 32, got {warps}")
    check_v2_tile(cfg.get("block_n", 16), cfg.get("block_k", 64), cfg.get("k_slices", 1))
    return dict(cfg)


def parse_tuned_table(data: object, source: str) -> dict[str, dict]:
    """Validated ``configs`` of a table (``{"configs": {key: {option: value}}, ...}``; other
    top-level fields are notes).  Errors name ``source`` and the entry's key."""
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise TunedTableError(f"{source}: expected a JSON object with a 'configs' object")
    table = {}
    for key, cfg in data["configs"].items():
        try:
            _check_key(key)
            table[key] = _check_entry(cfg)
        except ValueError as e:
            raise TunedTableError(f"{source}: entry {key!r}: {e}") from None
    return table


@functools.lru_cache(maxsize=8)
def _read_tuned(path: str, required: bool) -> dict[str, dict]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise TunedTableError(f"{path}: no such tuned-config table ({TUNED_ENV})") from None
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TunedTableError(f"{path}: not valid JSON: {e}") from None
    return parse_tuned_table(data, path)


def tuned_table() -> dict[str, dict]:
    """The tuned configs in force, read once per path: ``$BLOCKSPEC_W4A16_TUNED`` if set (a
    path, or ``none``), else the packaged ``w4a16_tuned.json`` (a missing one counts as empty)."""
    env = os.environ.get(TUNED_ENV, "")
    if env.lower() == "none":
        return {}
    return _read_tuned(env or str(TUNED_PATH), bool(env))


def tuned_config(n: int, k: int, m: int, blocks: int | None = None) -> dict:
    """The tuned entry for the call's class (``problem_key``), or {} where the table has none."""
    return dict(tuned_table().get(problem_key(n, k, m, blocks), {}))


def v2_default_config(n: int, k: int, m: int, *, blocks: int | None = None,
                      block_m: int | None = None, tuned: bool = True) -> dict:
    """Launch config of the v2 kernels for what the caller leaves unnamed: the tuned entry of
    the call's class over the built-in defaults (``_builtin_v2_config``).

    ``m``: rows of x for a dense call, rows per block for a grouped one (with ``blocks`` row
    blocks).  ``block_m``: a row block the caller chose for a dense call; the built-in tile
    follows it, as before the table.  ``split_k`` None: ``_pick_split_k`` decides.
    """
    cfg = _builtin_v2_config(n, k, m if block_m is None else block_m)
    if tuned:
        cfg.update(tuned_config(n, k, m, blocks))
    return cfg


def _launch_v2(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               ws2: torch.Tensor, tables: tuple[torch.Tensor, ...] | None, num_blocks: int,
               block_m: int, n: int, k: int, out_dtype: torch.dtype, variant: str,
               block_n: int | None = None, block_k: int | None = None,
               k_slices: int | None = None, split_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               maxnreg: int | None = None, pairs: dict | None = None,
               relu2: bool = False) -> torch.Tensor:
    """``tables``: (expert, row0, row1) per row block for the grouped GEMM, None for dense.
    ``pairs`` (``pair_w4a16``): ``ids`` [tokens, topk], ``x_per_pair``, ``dedup``; one block
    per pair, ``num_blocks`` = pairs, ``out`` has a row per pair. ``relu2``: relu(.)^2 of
    the rounded output, in the kernel's epilogue.

    Keywords left None come from ``v2_default_config``; the tuned table applies to ``v2``
    only (the other variants are comparisons, and ``v2w`` needs its own tile shapes).
    """
    interpret = interpreting()
    kernel = _kernels_v2(interpret)
    if tables is None and pairs is None:
        cfg = v2_default_config(n, k, x.shape[0], block_m=block_m, tuned=variant == "v2")
    else:
        cfg = v2_default_config(n, k, block_m, blocks=num_blocks, tuned=variant == "v2")
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    slices = k_slices or cfg["k_slices"]
    swap = variant == "v2w" or (cfg["swap"] and slices == 1 and block_n % 64 == 0)
    check_v2_tile(block_n, block_k, slices)
    if swap and (slices != 1 or block_n % 64):
        raise ValueError("v2w (wgmma) needs k_slices=1 and block_n a multiple of 64")
    chunk = block_k * slices
    tiles_n = -(-n // block_n)
    split = (split_k or cfg["split_k"]
             or _pick_split_k(num_blocks * tiles_n, k, chunk, sm_count(x.device, cpu=4),
                              waves=1.5))
    split, k_per_split = split_plan(k, chunk, split)
    # The kernel reads x as int64 words (4 bf16) and W as uint16 words (4 nibbles).
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    if x.stride(0) % 4 or x.data_ptr() % 8:
        x = x.clone()
    if weight.data_ptr() % 2:
        weight = weight.clone()
    rows = x.shape[0] if pairs is None else pairs["rows"]
    out = torch.empty((rows, n), dtype=torch.float32 if interpret else out_dtype,
                      device=x.device)
    num_tiles = num_blocks * tiles_n
    if split > 1:
        part = torch.empty(split * num_tiles * block_m * block_n, dtype=torch.float32,
                           device=x.device)
        counters = _tile_counters(x.device, num_tiles)
    else:
        part, counters = out, ws2  # unused
    w3 = weight if weight.dim() == 3 else weight.unsqueeze(0)
    s3 = weight_scale if weight_scale.dim() == 3 else weight_scale.unsqueeze(0)
    s3 = s3.view(torch.uint8)
    if interpret:
        decode, extra = _DEC_FP32, {}
    else:
        decode = _DEC_TRITON if variant == "v2t" else _DEC_ASM
        extra = {"num_warps": num_warps or cfg["num_warps"],
                 "num_stages": num_stages or cfg["num_stages"]}
        if (maxnreg or cfg["maxnreg"]) is not None:  # a register cap buys CTAs per SM
            extra["maxnreg"] = maxnreg or cfg["maxnreg"]
    if pairs is not None:
        ids = pairs["ids"]
        tables, m_arg = (ids.reshape(-1),) * 3, ids.shape[0]
        extra.update(PAIRS=1, TOPK=ids.shape[1], X_PER_PAIR=pairs["x_per_pair"],
                     DEDUP=pairs["dedup"], DISTINCT=pairs["distinct"], SHARED=pairs["shared"],
                     SHARED_BASE=w3.shape[0] - pairs["shared"])
    else:
        m_arg = rows
    kernel[(num_blocks, tiles_n, split)](
        x, w3, s3, ws2, out, part, counters, *(tables or (ws2, ws2, ws2)),
        m_arg, n, k, k_per_split, num_tiles,
        x.stride(0), w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SLICES=slices, SPLIT=split,
        SWAP=swap, DECODE=decode, GROUPED=tables is not None and pairs is None,
        EVEN_N=n % block_n == 0,
        MASK_K=interpret or k % chunk != 0, SCALE_WORDS=k % 64 == 0 and block_k >= 128,
        K_ITERS=k_per_split // chunk if interpret else 0, RELU2=relu2,
        **extra,
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)


VARIANTS = ("v2", "v2t", "v2w")
VARIANT_ENV = "BLOCKSPEC_W4A16_VARIANT"


def default_variant() -> str:
    """``BLOCKSPEC_W4A16_VARIANT`` if set, else ``v2`` (fastest on every shape on the H200,
    docs/benchmarks.md)."""
    v = os.environ.get(VARIANT_ENV, "") or "v2"
    if v not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={v!r}: expected one of {VARIANTS}")
    return v


def _variant(variant: str | None) -> str:
    variant = variant or default_variant()
    if variant not in VARIANTS:
        raise ValueError(f"unknown W4A16 variant {variant!r}: expected one of {VARIANTS}")
    return variant


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


def w4a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
                 variant: str | None = None, block_m: int | None = None,
                 block_n: int | None = None, block_k: int | None = None,
                 k_slices: int | None = None, split_k: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 maxnreg: int | None = None, relu2: bool = False) -> torch.Tensor:
    """``x[..., K] @ dequant(W)^T (+ bias)`` -> ``[..., N]`` in x's dtype, via the Triton kernel
    (``weight`` in the kernel layout).

    ``variant``: one of ``VARIANTS`` (default: ``default_variant()``); the other keywords
    override the tile configuration (``maxnreg``: a register cap per thread). ``relu2``:
    relu(.)^2 of the rounded result in the kernel's epilogue (an expert's up projection;
    not with a bias, which is added after the kernel).
    """
    n, k = _check(x, weight, weight_scale)
    if relu2 and bias is not None:
        raise ValueError("w4a16_linear: relu2 is fused before the bias is added; pass one")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out_dtype = x.dtype
    if m == 0:
        return x.new_empty((*lead, n))
    cfg = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": num_warps,
           "num_stages": num_stages}
    variant = _variant(variant)
    ws2 = weight_scale_2.reshape(1).to(torch.float32)
    w, s = weight.contiguous(), weight_scale.contiguous()
    block_m = block_m or _builtin_v2_config(n, k, m)["block_m"]  # (not a tuned key)
    y = _launch_v2(x2, w, s, ws2, None, -(-m // block_m), block_m, n, k, out_dtype,
                   variant, k_slices=k_slices, maxnreg=maxnreg, relu2=relu2, **cfg)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, n)


def w4a16_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           weight_scale_2: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch ``w4a16_linear`` (same arguments, kernel layout): exact fp32 dequant, cast to
    x's dtype, ``F.linear``."""
    w = dequantize_nvfp4(from_kernel_layout(weight), weight_scale, weight_scale_2, dtype=x.dtype)
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
                  variant: str | None = None, block_n: int | None = None,
                  block_k: int | None = None, k_slices: int | None = None,
                  split_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, maxnreg: int | None = None,
                  relu2: bool = False) -> torch.Tensor:
    """MoE: ``x[T, K]`` sorted by expert; rows ``offsets[e]:offsets[e+1]`` use expert e.

    ``weight`` [E, N, K/2] uint8, ``weight_scale`` [E, N, K/16] E4M3, ``weight_scale_2`` [E]
    fp32.  Returns ``[T, N]`` in x's dtype.  The offsets may cover only the stack's first
    experts (the MoE's stacks end in the shared expert's slices, which only the pair path
    reads).  ``blocks`` (from ``grouped_blocks``) lets the up and down projections of one MoE
    layer share the row-block table.  ``variant``, the tile keywords and ``relu2`` (an expert's
    up projection: relu(.)^2 in the epilogue) are as in ``w4a16_linear``.
    """
    n, k = _check(x, weight, weight_scale)
    if weight.dim() != 3:
        raise ValueError(f"grouped weights must be [E, N, K/2], got {tuple(weight.shape)}")
    e = weight.shape[0]
    if not 2 <= expert_offsets.numel() <= e + 1:
        raise ValueError(f"expert_offsets needs 2 to E+1={e + 1} entries (one more than the "
                         f"experts it covers), got {expert_offsets.numel()}")
    t = x.shape[0]
    if t == 0:
        return x.new_empty((0, n))
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    if blocks is None:
        blocks = grouped_blocks(expert_offsets.to(x.device), t)
    blk_expert, row0, row1, nb, block_m = blocks
    ws2 = weight_scale_2.reshape(e).to(torch.float32)
    cfg = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": num_warps,
           "num_stages": num_stages}
    w, s = weight.contiguous(), weight_scale.contiguous()
    return _launch_v2(x2, w, s, ws2, (blk_expert, row0, row1), nb, block_m, n, k, x.dtype,
                      _variant(variant), k_slices=k_slices, maxnreg=maxnreg,
                      relu2=relu2, **cfg)


# A pair tile's rows are the tokens of one expert under ``dedup`` (BLOCK_M = 16 at decode).
PAIR_DEDUP_MAX_TOKENS = 16


def pair_w4a16(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
               x_per_pair: bool = False, dedup: bool = False, relu2: bool = False,
               distinct: bool = False, shared_parts: int = 0,
               **tile: int | None) -> torch.Tensor:
    """MoE at decode sizes, one launch: pair p = (token p // k, expert ``ids.flat[p]``) ->
    row p of the ``[T*k, N]`` result in x's dtype (``x`` [T, K], or one row per output row
    with ``x_per_pair``). Stacked weights as in ``grouped_w4a16``; no sort, gather or
    row-block table (the kernel reads ``ids``). ``dedup`` (at most ``PAIR_DEDUP_MAX_TOKENS``
    tokens): the pairs of one expert share a program, which decodes the expert's weights once
    and multiplies them by all its tokens' rows in one MMA tile (a speculative verify's tokens
    often share experts; decoding, not only reading, is what a W4A16 call pays for);
    ``distinct`` promises no token names an expert twice (top-k routing), which skips the
    kernel's repeat count. ``relu2`` applies relu(.)^2 to the rounded result (an expert's up
    projection).

    ``shared_parts`` = S > 0: the stack's last S experts are slices of the shared expert,
    which every token uses without being routed to them: the result gets S more rows per
    token after the routed ones (row T*k + t*S + s), in the same launch. ``tile``: the tile
    keywords of ``w4a16_linear``."""
    n, k = _check(x, weight, weight_scale)
    if weight.dim() != 3:
        raise ValueError(f"pair_w4a16: weight must be stacked [E, N, K/2], got "
                         f"{tuple(weight.shape)}")
    if ids.dim() != 2:
        raise ValueError(f"pair_w4a16: ids must be [tokens, k], got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pair_w4a16: ids must be int32 or int64, got {ids.dtype}")
    e = weight.shape[0]
    if not 0 <= shared_parts < e:
        raise ValueError(f"pair_w4a16: shared_parts={shared_parts} does not fit {e} experts")
    tokens, topk = ids.shape
    pairs = tokens * topk
    rows = pairs + tokens * shared_parts
    want = rows if x_per_pair else tokens
    if x.shape[0] != want:
        raise ValueError(f"pair_w4a16: x has {x.shape[0]} rows, expected {want} "
                         f"({'one per output row' if x_per_pair else 'one per token'})")
    if dedup and tokens > PAIR_DEDUP_MAX_TOKENS:
        raise ValueError(f"pair_w4a16: dedup takes at most {PAIR_DEDUP_MAX_TOKENS} tokens, "
                         f"got {tokens}")
    if pairs == 0:
        return x.new_empty((rows, n))
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    ws2 = weight_scale_2.reshape(e).to(torch.float32)
    ids = ids.contiguous()      # read in its own dtype: no conversion kernel per call
    blocks = pairs + (shared_parts if dedup else tokens * shared_parts)
    variant = default_variant()
    return _launch_v2(x2, weight.contiguous(), weight_scale.contiguous(), ws2, None, blocks, 16,
                      n, k, x.dtype, variant, relu2=relu2, **tile,
                      pairs={"ids": ids, "x_per_pair": x_per_pair, "dedup": dedup,
                             "distinct": distinct, "shared": shared_parts, "rows": rows})


def pair_w4a16_reference(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
                         x_per_pair: bool = False, relu2: bool = False,
                         shared_parts: int = 0) -> torch.Tensor:
    """Pure torch ``pair_w4a16`` (same arguments, kernel layout): each output row through its
    exactly dequantized expert."""
    tokens, topk = ids.shape
    e = weight.shape[0]
    experts = ids.reshape(-1).tolist() + [e - shared_parts + s for _ in range(tokens)
                                          for s in range(shared_parts)]
    token_of = [p // topk for p in range(tokens * topk)] + [t for t in range(tokens)
                                                           for _ in range(shared_parts)]
    out = []
    for r, ex in enumerate(experts):
        w = dequantize_nvfp4(from_kernel_layout(weight[ex]), weight_scale[ex],
                             weight_scale_2.reshape(-1)[ex], dtype=x.dtype)
        row = r if x_per_pair else token_of[r]
        out.append(F.linear(x[row:row + 1], w))
    y = torch.cat(out) if out else x.new_empty((0, weight.shape[-2]))
    return torch.square(F.relu(y)) if relu2 else y


def grouped_blocks(expert_offsets: torch.Tensor, rows: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Row-block table for ``grouped_w4a16``: (expert, row0, row1, count, block_m)."""
    e = expert_offsets.numel() - 1
    block_m = _pick_block_m(max(1, rows // max(1, min(e, rows))))
    return (*expert_blocks(expert_offsets, rows, block_m), block_m)


def grouped_w4a16_reference(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor,
                            weight_scale: torch.Tensor,
                            weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Pure torch ``grouped_w4a16`` (kernel layout): each expert's rows through its exactly
    dequantized weight."""
    n = weight.shape[-2]
    out = x.new_zeros((x.shape[0], n))
    offs = [int(v) for v in expert_offsets.tolist()]
    for e in range(weight.shape[0]):
        a, b = offs[e], offs[e + 1]
        if a == b:
            continue
        w = dequantize_nvfp4(from_kernel_layout(weight[e]), weight_scale[e],
                             weight_scale_2.reshape(-1)[e], dtype=x.dtype)
        out[a:b] = F.linear(x[a:b], w)
    return out
