"""Triton kernels of paged attention (``kernels/paged_attention.py`` has the launcher and the
layout of the work; ``kernels/triton_loader.py`` loads this file once per mode)."""
import triton
import triton.language as tl

# Reductions go through tl.reduce with tl.standard's max and sum combines (see triton_loader):
# the same code as local ones when compiled, and the interpreter reduces them with numpy.
# Scores are kept in base 2: the launcher passes scale x log2(e), so each score costs one
# multiply and one ex2 (tl.exp would add a second multiply); the running max m, the split
# partials and the sinks (scaled by the launcher too) are all base-2 logits.


@triton.jit
def _key_block(q, K, V, BT, slot, s_bt, s_kn, s_kh, h, d, dmask, kp, kmask, qpos, row_ok,
               m_i, l_i, acc, scale, window, PAGE: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOWED: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr = True,
               EVEN_D: tl.constexpr = False):
    """One block of keys folded into the running softmax state (m, l, acc). Not ``MASKED``:
    a block every row of the tile may see whole (in bounds, at or before every row's
    position, no window), so no mask is computed or applied."""
    if MASKED:
        page = tl.load(BT + slot * s_bt + kp // PAGE, mask=kmask, other=0)
    else:
        page = tl.load(BT + slot * s_bt + kp // PAGE)
    ks = page.to(tl.int64) * PAGE + kp % PAGE
    kptr = ks[:, None] * s_kn + h * s_kh + d[None, :]
    if MASKED:
        kvmask = kmask[:, None] & dmask[None, :]
        k = tl.load(K + kptr, mask=kvmask, other=0.0)
        v = tl.load(V + kptr, mask=kvmask, other=0.0)
    elif EVEN_D:
        k = tl.load(K + kptr)
        v = tl.load(V + kptr)
    else:
        k = tl.load(K + kptr, mask=dmask[None, :], other=0.0)
        v = tl.load(V + kptr, mask=dmask[None, :], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if MASKED:
        allowed = kmask[None, :] & row_ok[:, None]
        if CAUSAL:
            allowed = allowed & (kp[None, :] <= qpos[:, None])
        if WINDOWED:
            allowed = allowed & ((qpos[:, None] - kp[None, :]) < window)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc

@triton.jit
def _attn_kernel(Q, K, V, O, PM, PL, PO, BT, SLOTS, SEQ, QST, TILE_REQ, TILE_R0, SINK,
                 scale, window, s_qn, s_qh, s_kn, s_kh, s_on, s_oh, s_bt,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HAS_SINK: tl.constexpr,
                 IEEE: tl.constexpr, STATIC_ITERS: tl.constexpr,
                 FULL_BLOCKS: tl.constexpr = False, EVEN_D: tl.constexpr = False):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n_kv = tl.num_programs(1)
    b = tl.load(TILE_REQ + tile)
    r0 = tl.load(TILE_R0 + tile)
    slot = tl.load(SLOTS + b).to(tl.int64)
    L = tl.load(SEQ + b).to(tl.int32)
    qs = tl.load(QST + b).to(tl.int32)
    qn = tl.load(QST + b + 1).to(tl.int32) - qs
    m = r0 + tl.arange(0, BLOCK_M)
    t = m // G
    head = h * G + m % G
    row_ok = t < qn
    qpos = L - qn + t
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + (qs + t)[:, None].to(tl.int64) * s_qn + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)
    # keys this tile can see, then this program's share of them
    t_last = tl.minimum((r0 + BLOCK_M - 1) // G, qn - 1)
    hi = L
    if CAUSAL:
        hi = tl.minimum(L, L - qn + t_last + 1)
    lo = L * 0
    if WINDOWED:
        lo = tl.maximum(lo, L - qn + r0 // G - window + 1)
    per_split = (hi - lo + SPLITS - 1) // SPLITS
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = lo + sp * chunk
    end = tl.minimum(start + chunk, hi)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    # FULL_BLOCKS: the whole key blocks every row may see (before the tile's first query
    # position) run unmasked first, the rest masked; otherwise every block is masked
    full_end = start
    if FULL_BLOCKS and not WINDOWED:
        free = end
        if CAUSAL:
            free = tl.minimum(free, L - qn + r0 // G + 1)
        full_end = start + tl.maximum(free - start, 0) // BLOCK_N * BLOCK_N
    if STATIC_ITERS > 0:
        # the interpreter cannot loop over loaded bounds: a fixed trip count, masked
        for it in range(STATIC_ITERS):
            s0 = start + it * BLOCK_N
            kp = s0 + tl.arange(0, BLOCK_N)
            if s0 + BLOCK_N <= full_end:
                m_i, l_i, acc = _key_block(q, K, V, BT, slot, s_bt, s_kn, s_kh, h, d, dmask,
                                           kp, kp < end, qpos, row_ok, m_i, l_i, acc, scale,
                                           window, PAGE, CAUSAL, WINDOWED, IEEE, False, EVEN_D)
            else:
                m_i, l_i, acc = _key_block(q, K, V, BT, slot, s_bt, s_kn, s_kh, h, d, dmask,
                                           kp, kp < end, qpos, row_ok, m_i, l_i, acc, scale,
                                           window, PAGE, CAUSAL, WINDOWED, IEEE)
    else:
        if FULL_BLOCKS and not WINDOWED:
            for s0 in range(start, full_end, BLOCK_N):
                kp = s0 + tl.arange(0, BLOCK_N)
                m_i, l_i, acc = _key_block(q, K, V, BT, slot, s_bt, s_kn, s_kh, h, d, dmask,
                                           kp, kp < end, qpos, row_ok, m_i, l_i, acc, scale,
                                           window, PAGE, CAUSAL, WINDOWED, IEEE, False, EVEN_D)
        for s0 in range(full_end, end, BLOCK_N):
            kp = s0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _key_block(q, K, V, BT, slot, s_bt, s_kn, s_kh, h, d, dmask, kp,
                                       kp < end, qpos, row_ok, m_i, l_i, acc, scale, window,
                                       PAGE, CAUSAL, WINDOWED, IEEE)
    if SPLITS == 1:
        if HAS_SINK:
            sink = tl.load(SINK + head, mask=row_ok, other=0.0)
            m_f = tl.maximum(m_i, sink)
            scale_old = tl.exp2(m_i - m_f)
            l_i = l_i * scale_old + tl.exp2(sink - m_f)
            acc = acc * scale_old[:, None]
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        optr = O + (qs + t)[:, None].to(tl.int64) * s_on + head[:, None] * s_oh + d[None, :]
        tl.store(optr, out.to(O.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
    else:
        base = (tile * n_kv + h) * SPLITS + sp
        rows = base * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(PM + rows, m_i)
        tl.store(PL + rows, l_i)
        tl.store(PO + rows[:, None].to(tl.int64) * BLOCK_D + d[None, :], acc)

@triton.jit
def _merge_kernel(O, PM, PL, PO, QST, TILE_REQ, TILE_R0, SINK, s_on, s_oh,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  SPLITS: tl.constexpr, HAS_SINK: tl.constexpr, MERGE_M: tl.constexpr,
                  MERGE_D: tl.constexpr):
    """Combine the SPLITS partial softmax states of a (tile, kv head) for MERGE_M rows and
    MERGE_D columns: many small programs, since a decode step has only a few (tile, head)
    pairs and each one's partials are SPLITS x BLOCK_M x BLOCK_D floats."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    chunk = tl.program_id(2)
    n_kv = tl.num_programs(1)
    n_d: tl.constexpr = BLOCK_D // MERGE_D
    lm = (chunk // n_d) * MERGE_M + tl.arange(0, MERGE_M)
    d = (chunk % n_d) * MERGE_D + tl.arange(0, MERGE_D)
    b = tl.load(TILE_REQ + tile)
    r0 = tl.load(TILE_R0 + tile)
    qs = tl.load(QST + b)
    qn = tl.load(QST + b + 1) - qs
    m = r0 + lm
    t = m // G
    head = h * G + m % G
    row_ok = t < qn
    dmask = d < D
    first = (tile * n_kv + h) * SPLITS * BLOCK_M + lm
    m_all = tl.full([MERGE_M], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        m_all = tl.maximum(m_all, tl.load(PM + first + s * BLOCK_M))
    if HAS_SINK:
        sink = tl.load(SINK + head, mask=row_ok, other=0.0)
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_tot = tl.full([MERGE_M], 0.0, tl.float32)
    acc = tl.full([MERGE_M, MERGE_D], 0.0, tl.float32)
    for s in tl.static_range(SPLITS):
        rows = first + s * BLOCK_M
        w = tl.exp2(tl.load(PM + rows) - m_safe)
        l_tot += tl.load(PL + rows) * w
        acc += tl.load(PO + rows[:, None].to(tl.int64) * BLOCK_D + d[None, :]) * w[:, None]
    if HAS_SINK:
        l_tot += tl.exp2(sink - m_safe)
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
    optr = O + (qs + t)[:, None].to(tl.int64) * s_on + head[:, None] * s_oh + d[None, :]
    tl.store(optr, out.to(O.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
