"""Triton kernel of the MoE W4A16 pair calls of a speculative verify, scheduled stream-K
(``kernels/w4a16_streamk.py`` has the launcher and says why).

The work of one call is the flat sequence of K steps of every (distinct expert, N tile) item,
the shared expert's slices last; each of the G programs takes one contiguous share of it. An
item that a share boundary cuts is finished by the last program to reach it: each piece parks
its fp32 partial (slot 0 for a program's first item, 1 for its last), bumps the item's counter,
and the last one sums the pieces in program order (deterministic) and runs the epilogue,
resetting the counter. The decode, the MMA and the exact scaling are those of
``_w4a16_kernels.py`` (it explains them); x rows are the tokens routed to the item's expert.
Under the interpreter (``INTERP``) loops need Python bounds: they run over everything and skip
what is not the program's.
"""
import triton
import triton.language as tl


@triton.jit
def _sk_step(acc, w_ptrs, s_ptrs, x_ptrs, wmask, xmask, it,
             BLOCK_N: tl.constexpr, QK: tl.constexpr, GROUPS: tl.constexpr, GS: tl.constexpr,
             SCALE_WORDS: tl.constexpr, DECODE: tl.constexpr, EVEN_N: tl.constexpr):
    """One K step (``it``) of a [16, BLOCK_N] tile: load, decode, four dots."""
    if EVEN_N:
        wq = tl.load(w_ptrs + it * QK)
        sb = tl.load(s_ptrs + it * GS)
    else:
        wq = tl.load(w_ptrs + it * QK, mask=wmask, other=0)
        sb = tl.load(s_ptrs + it * GS, mask=wmask, other=0)
    xq = tl.load(x_ptrs + it * QK, mask=xmask, other=0)
    if SCALE_WORDS:
        sb = tl.join(tl.join(sb & 0xFF, (sb >> 16) & 0xFF),
                     tl.join((sb >> 8) & 0xFF, (sb >> 24) & 0xFF))
        sb = tl.reshape(sb, (BLOCK_N, GROUPS))
    sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_N, GROUPS, 4)), (BLOCK_N, QK))
    sf = ((sb.to(tl.int32) & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True)
    sf = sf.to(tl.float32) * 8.507059173023462e+37
    if DECODE == 1:
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
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        x0 = (xq & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        x1 = ((xq >> 16) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        x2 = ((xq >> 32) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        x3 = ((xq >> 48) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:  # the same bits in fp32 (the interpreter)
        q = wq.to(tl.int32)
        sw = ((q >> 8) | (q << 8)) & 0xFFFF
        w0 = (((q << 2) & 0x81C0) << 16).to(tl.float32, bitcast=True) * sf
        w1 = (((q << 6) & 0x81C0) << 16).to(tl.float32, bitcast=True) * sf
        w2 = (((sw << 4) & 0x81C0) << 16).to(tl.float32, bitcast=True) * sf
        w3 = (((q & 0x8180) | (sw & 0x0040)) << 16).to(tl.float32, bitcast=True) * sf
        x0 = ((xq & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
        x1 = (((xq >> 16) & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
        x2 = (((xq >> 32) & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
        x3 = (((xq >> 48) & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
    acc = tl.dot(x0, tl.trans(w0), acc)
    acc = tl.dot(x1, tl.trans(w1), acc)
    acc = tl.dot(x2, tl.trans(w2), acc)
    acc = tl.dot(x3, tl.trans(w3), acc)
    return acc


@triton.jit
def _sk_fence(DECODE: tl.constexpr):
    if DECODE != 2:  # every thread, as __threadfence() would (no PTX in the interpreter)
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.u32 $0, 0;", "=r,r",
                                  [tl.full([1], 0, tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _sk_store(acc, gscale, out_ptrs, omask, RELU2: tl.constexpr):
    y = (acc * gscale).to(out_ptrs.dtype.element_ty)
    if RELU2:  # relu(.)^2 of the rounded value, as relu2(linear(x)) computes it
        yf = tl.maximum(y.to(tl.float32), 0.0)
        y = (yf * yf).to(out_ptrs.dtype.element_ty)
    tl.store(out_ptrs, y, mask=omask)


@triton.jit
def _sk_leaders(ids_ptr, N_PAIRS: tl.constexpr, P_BLOCK: tl.constexpr):
    """(ids, leads, rank among leaders, leader count): pair p leads if no earlier pair names
    its expert, so leaders in pair order list the distinct experts."""
    pp = tl.arange(0, P_BLOCK)
    pmask = pp < N_PAIRS
    ids = tl.load(ids_ptr + pp, mask=pmask, other=-1)
    earlier = pp * 0    # a loop of scalar reads, not a [P, P] tile: few registers
    for q in tl.static_range(N_PAIRS):
        earlier += ((ids == tl.load(ids_ptr + q)) & (pp > q)).to(tl.int32)
    lead = pmask & (earlier == 0)
    rank = tl.associative_scan(lead.to(tl.int32), 0, tl.standard._sum_combine) - 1
    return ids, lead, rank, tl.reduce(lead.to(tl.int32), 0, tl.standard._sum_combine)


@triton.jit
def _sk_piece(part_ptr, offs, c, per, item, K_ITERS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program c's partial of ``item``: slot 0 if it is c's first item, else slot 1."""
    slot = ((c * per) // K_ITERS != item).to(tl.int64)
    return tl.load(part_ptr + (c * 2 + slot) * (16 * BLOCK_N) + offs, cache_modifier=".cg")


@triton.jit
def _sk_item(item, k0, k1, first_item, per, pid, w_ptr, ws_ptr, x_ptr, ids_ptr, ws2_ptr,
             out_ptr, part_ptr, cnt_ptr, N, stride_xm, stride_we, stride_wn, stride_se,
             stride_sn, stride_om,
             TOKENS: tl.constexpr, TOPK: tl.constexpr, P_BLOCK: tl.constexpr,
             SHARED: tl.constexpr, SHARED_BASE: tl.constexpr, N_TILES: tl.constexpr,
             K_ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             X_PER_PAIR: tl.constexpr, RELU2: tl.constexpr, DECODE: tl.constexpr,
             SCALE_WORDS: tl.constexpr, EVEN_N: tl.constexpr, INTERP: tl.constexpr,
             PROGS: tl.constexpr):
    """K steps k0..k1 of one (expert, N tile) item, then its epilogue or its partial. Its
    operands are rebuilt here from scalars, so nothing but them lives across items."""
    BLOCK_M: tl.constexpr = 16
    QK: tl.constexpr = BLOCK_K // 4
    GROUPS: tl.constexpr = BLOCK_K // 16
    GS: tl.constexpr = GROUPS // 4 if SCALE_WORDS else GROUPS
    N_PAIRS: tl.constexpr = TOKENS * TOPK
    ids, lead, rank, n_lead = _sk_leaders(ids_ptr, N_PAIRS, P_BLOCK)
    lanes = tl.arange(0, BLOCK_M)
    tm = lanes < TOKENS
    jq = tl.arange(0, QK)
    jg = tl.arange(0, GS)
    w_base = w_ptr.to(tl.pointer_type(tl.uint16))
    s_base = ws_ptr.to(tl.pointer_type(tl.int32)) if SCALE_WORDS else ws_ptr
    sn = stride_sn // 4 if SCALE_WORDS else stride_sn
    x_base = x_ptr.to(tl.pointer_type(tl.int64))
    r = item // N_TILES
    pid_n = item % N_TILES
    is_sh = r >= n_lead
    e_routed = tl.reduce(tl.where(lead & (rank == r), ids, 0), 0,
                         tl.standard._sum_combine)
    expert = tl.where(is_sh, SHARED_BASE + r - n_lead, e_routed).to(tl.int64)
    pair_of = tl.full([BLOCK_M], -1, tl.int32)
    for jj in tl.static_range(TOPK):
        col = tl.load(ids_ptr + lanes * TOPK + jj, mask=tm, other=-1)
        pair_of = tl.where(col == e_routed, lanes * TOPK + jj, pair_of)
    rmask = tl.where(is_sh, tm, pair_of >= 0)
    out_rows = tl.where(is_sh, N_PAIRS + lanes * SHARED + (r - n_lead), pair_of)
    if X_PER_PAIR:
        x_rows = out_rows
    else:
        x_rows = lanes
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    cols64 = cols.to(tl.int64)
    w_ptrs = (w_base + expert * (stride_we // 2) + cols64[:, None] * (stride_wn // 2)
              + jq[None, :])
    s_ptrs = s_base + expert * (stride_se // (4 if SCALE_WORDS else 1)) + \
        cols64[:, None] * sn + jg[None, :]
    x_ptrs = x_base + tl.maximum(x_rows, 0).to(tl.int64)[:, None] * (stride_xm // 4) \
        + jq[None, :]
    wmask = nmask[:, None]
    xmask = rmask[:, None]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if INTERP:
        for it in range(0, K_ITERS):
            if (it >= k0) & (it < k1):
                acc = _sk_step(acc, w_ptrs, s_ptrs, x_ptrs, wmask, xmask, it, BLOCK_N,
                               QK, GROUPS, GS, SCALE_WORDS, DECODE, EVEN_N)
    else:
        for it in range(k0, k1):
            acc = _sk_step(acc, w_ptrs, s_ptrs, x_ptrs, wmask, xmask, it, BLOCK_N,
                           QK, GROUPS, GS, SCALE_WORDS, DECODE, EVEN_N)
    gscale = tl.load(ws2_ptr + expert) * 256.0
    out_ptrs = out_ptr + tl.maximum(out_rows, 0).to(tl.int64)[:, None] * stride_om \
        + cols[None, :]
    omask = rmask[:, None] & nmask[None, :]
    if (k0 == 0) & (k1 == K_ITERS):
        _sk_store(acc, gscale, out_ptrs, omask, RELU2)
    else:
        offs = lanes[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        slot = (item != first_item).to(tl.int64)
        tl.store(part_ptr + (pid.to(tl.int64) * 2 + slot) * (BLOCK_M * BLOCK_N) + offs,
                 acc)
        _sk_fence(DECODE)
        tl.debug_barrier()
        c_lo = (item * K_ITERS) // per
        c_hi = ((item + 1) * K_ITERS - 1) // per
        done = tl.atomic_add(cnt_ptr + item, 1)
        if done == c_hi - c_lo:
            _sk_fence(DECODE)
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            if INTERP:  # Python bounds: every program, skipping the others
                for c in range(0, PROGS):
                    if (c >= c_lo) & (c <= c_hi):
                        acc += _sk_piece(part_ptr, offs, c, per, item, K_ITERS, BLOCK_N)
            else:
                for c in range(c_lo, c_hi + 1):
                    acc += _sk_piece(part_ptr, offs, c, per, item, K_ITERS, BLOCK_N)
            tl.atomic_xchg(cnt_ptr + item, 0)
            _sk_store(acc, gscale, out_ptrs, omask, RELU2)


@triton.jit
def _w4a16_pairs_streamk_kernel(
    x_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr, part_ptr, cnt_ptr, ids_ptr,
    N, progs, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    TOKENS: tl.constexpr, TOPK: tl.constexpr, P_BLOCK: tl.constexpr,
    SHARED: tl.constexpr, SHARED_BASE: tl.constexpr, N_TILES: tl.constexpr,
    K_ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_PER_PAIR: tl.constexpr, RELU2: tl.constexpr, DECODE: tl.constexpr,
    SCALE_WORDS: tl.constexpr, EVEN_N: tl.constexpr, INTERP: tl.constexpr,
    PROGS: tl.constexpr, ITEMS: tl.constexpr,
):
    N_PAIRS: tl.constexpr = TOKENS * TOPK
    pid = tl.program_id(0)
    _, _, _, n_lead = _sk_leaders(ids_ptr, N_PAIRS, P_BLOCK)
    total = (n_lead + SHARED) * (N_TILES * K_ITERS)
    per = (total + progs - 1) // progs
    start = pid * per
    end = tl.minimum(start + per, total)
    first_item = start // K_ITERS
    if INTERP:  # Python bounds: every item, skipping those outside [start, end)
        for item in range(0, ITEMS):
            k0 = tl.maximum(start - item * K_ITERS, 0)
            k1 = tl.minimum(end - item * K_ITERS, K_ITERS)
            if k0 < k1:
                _sk_item(item, k0, k1, first_item, per, pid, w_ptr, ws_ptr, x_ptr, ids_ptr,
                         ws2_ptr, out_ptr, part_ptr, cnt_ptr, N, stride_xm, stride_we,
                         stride_wn, stride_se, stride_sn, stride_om, TOKENS, TOPK, P_BLOCK,
                         SHARED, SHARED_BASE, N_TILES, K_ITERS, BLOCK_N, BLOCK_K, X_PER_PAIR,
                         RELU2, DECODE, SCALE_WORDS, EVEN_N, INTERP, PROGS)
    else:
        for item in range(first_item, (end + K_ITERS - 1) // K_ITERS):
            k0 = tl.maximum(start - item * K_ITERS, 0)
            k1 = tl.minimum(end - item * K_ITERS, K_ITERS)
            _sk_item(item, k0, k1, first_item, per, pid, w_ptr, ws_ptr, x_ptr, ids_ptr,
                     ws2_ptr, out_ptr, part_ptr, cnt_ptr, N, stride_xm, stride_we, stride_wn,
                     stride_se, stride_sn, stride_om, TOKENS, TOPK, P_BLOCK, SHARED,
                     SHARED_BASE, N_TILES, K_ITERS, BLOCK_N, BLOCK_K, X_PER_PAIR, RELU2,
                     DECODE, SCALE_WORDS, EVEN_N, INTERP, PROGS)
