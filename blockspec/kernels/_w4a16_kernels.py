"""Triton kernel of the W4A16 NVFP4 GEMM: bf16 activations x packed E2M1 weights, decoded in
registers (``kernels/w4a16.py`` has the launchers and the references).

Decode (M <= 16) is memory bound, so the kernel reads each packed byte once, decodes it in
registers and feeds bf16 tensor-core dots. W is read as uint16 words of 4 nibbles (K order
4i..4i+3, the layout of ``kernels/w4a16_layout.py``), so a K block is 4 dots over "nibble
streams" r = 0..3, and x as int64 words (4 bf16) split the same way: a dot's K order is free as
long as x and W agree. Weights, x and (as int32 words) scales are staged by cp.async; Triton
converts the packed words to the MMA operand layout and each thread decodes whole 16-weight
scale groups in registers.

The decode is exact: code ``s e1 e0 m`` as bf16 bits ``s << 15 | (e1 e0 m) << 6`` is
E2M1 * 2^-126 (subnormal included); the block scale becomes bf16 ``scale * 2^118`` (exact, via
fp16 and fp32); their bf16 product is E2M1 * scale * 2^-8 exactly (<= 6 significant bits); and
``weight_scale_2 * 2^8`` scales the fp32 accumulator at the end. The MMA thus sees exact
E2M1 * E4M3 products. ``DECODE`` picks how the bits are made: 1 inline PTX (9 integer ops and
4 bf16x2 multiplies per 8 weights), 0 the same bits by Triton ops in bf16, 2 in fp32 (the
interpreter, whose bf16 dot and casts are unreliable; no PTX there either). ``SWAP`` computes
``W @ x^T`` so that wgmma reads x from shared memory; ``SPLIT`` > 1 splits K, and the last CTA
of each tile sums the partials (per-stream tile counters that it resets), so a call is one
launch. ``N_INNER`` (prefill) swaps the grid's axes so that a row block's N tiles are
scheduled together and its rows of x stay in L2. ``X_PERM`` (prefill) reads x with each
K chunk already in stream order (``x[4i + r]`` at ``r * CHUNK / 4 + i``, permuted by the
launcher), so the four x tiles are plain loads that go to shared memory as they are, with no
unpacking in registers. The kernel uses literal constants only, no module-level values.
"""
import triton
import triton.language as tl


@triton.jit
def _w4a16_min_fn(a, b):
    return tl.minimum(a, b)


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
    SHARED_BASE: tl.constexpr = 0, N_INNER: tl.constexpr = False,
    X_PERM: tl.constexpr = False, COL_SCALE: tl.constexpr = False,
):
    if N_INNER:  # grid (N tiles, row blocks): a row block's N tiles run side by side
        pid_b = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
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
    # weight_scale_2, times the 2^8 that the exact decode below leaves out (COL_SCALE: one
    # per output column, below, for sibling projections stacked into one weight).
    if not COL_SCALE:
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
    if COL_SCALE:
        gscale = (tl.load(ws2_ptr + cols, mask=nmask, other=0.0) * 256.0)[None, :]
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
        if X_PERM:  # bf16 elements (int16 bits in the interpreter): stream r is contiguous
            xe_base = x_ptr.to(tl.pointer_type(tl.int16)) if DECODE == 2 else x_ptr
            x_ptrs = xe_base + rows64[:, None] * stride_xm + kq
        else:
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
    x_ptrs += k_start if X_PERM else k_start // 4
    # (The interpreter's range() needs a Python int: K_ITERS, with MASK_K for the rest.)
    for it in range(0, K_ITERS if DECODE == 2 else (k_len + CHUNK - 1) // CHUNK):
        if MASK_K:  # K is not a multiple of the chunk (odd shapes only)
            k_left = k_len - it * CHUNK
            wq = tl.load(w_ptrs, mask=wmask & (kq < k_left // 4), other=0)
            sb = tl.load(s_ptrs, mask=wmask & (kg < k_left // (64 if SCALE_WORDS else 16)),
                         other=0)
            xkm = xmask & (kq < k_left // 4)
            if not X_PERM:
                xq = tl.load(x_ptrs, mask=xkm, other=0)
        elif EVEN_N:  # no weight mask at all, so the loads vectorize
            wq = tl.load(w_ptrs)
            sb = tl.load(s_ptrs)
            if not X_PERM:
                xq = tl.load(x_ptrs, mask=xmask, other=0)
        else:
            wq = tl.load(w_ptrs, mask=wmask, other=0)
            sb = tl.load(s_ptrs, mask=wmask, other=0)
            if not X_PERM:
                xq = tl.load(x_ptrs, mask=xmask, other=0)
        if X_PERM:  # the launcher put each chunk's K in stream order: 4 plain tiles of x
            xm = xkm if MASK_K else xmask
            x0 = tl.load(x_ptrs, mask=xm, other=0)
            x1 = tl.load(x_ptrs + QK, mask=xm, other=0)
            x2 = tl.load(x_ptrs + 2 * QK, mask=xm, other=0)
            x3 = tl.load(x_ptrs + 3 * QK, mask=xm, other=0)
            x_ptrs += CHUNK
        else:
            x_ptrs += CHUNK // 4
        w_ptrs += CHUNK // 4
        s_ptrs += CHUNK // (64 if SCALE_WORDS else 16)
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
        if X_PERM:
            if DECODE == 2:  # int16 bits -> fp32 (bf16 bits << 16)
                x0 = ((x0.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
                x1 = ((x1.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
                x2 = ((x2.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
                x3 = ((x3.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        elif DECODE == 2:
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
        if N_INNER:
            tile = pid_b * tl.num_programs(0) + pid_n
        else:
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
