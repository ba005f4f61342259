"""Triton kernels of the per-pair expert GEMV, plain and deduplicating (``kernels/moe_pairs.py``
has the launcher)."""
import triton
import triton.language as tl


@triton.jit
def _min_fn(a, b):
    return tl.minimum(a, b)


@triton.jit
def _pair_gemv_kernel(X, IDS, W, B, Y, N, K, s_x, s_we, s_wn, s_y,
                      TOPK: tl.constexpr, X_PER_PAIR: tl.constexpr, HAS_BIAS: tl.constexpr,
                      RELU2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      K_ITERS: tl.constexpr):
    """Pair p = (token p // TOPK, expert IDS[p]), columns [nb * BLOCK_N, ...): one row of x
    (the token's, or the pair's own with X_PER_PAIR) times that expert's weight rows, fp32
    accumulation, rounded to Y's dtype; RELU2 applies relu(.)^2 to the rounded value, as
    ``relu2(linear(x))`` does."""
    p = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    e = tl.load(IDS + p).to(tl.int64)
    row = p if X_PER_PAIR else p // TOPK
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for it in range(K_ITERS):      # a constexpr trip count (the interpreter needs one)
        k = it * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(X + row * s_x + k, mask=km, other=0.0).to(tl.float32)
        w = tl.load(W + e * s_we + n[:, None].to(tl.int64) * s_wn + k[None, :],
                    mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    # tl.standard's sum combine: the same code as a local one when compiled, and the
    # interpreter sums it with numpy instead of one Python call per element
    y = tl.reduce(acc, 1, tl.standard._sum_combine)
    if HAS_BIAS:
        y = y + tl.load(B + e * N + n, mask=nm, other=0.0).to(tl.float32)
    y = y.to(Y.dtype.element_ty)
    if RELU2:
        yf = tl.maximum(y.to(tl.float32), 0.0)
        y = (yf * yf).to(Y.dtype.element_ty)
    tl.store(Y + p * s_y + n, y, mask=nm)


@triton.jit
def _pair_gemv_dedup_kernel(X, IDS, W, B, Y, TOKENS, N, K, s_x, s_we, s_wn, s_y,
                            TOPK: tl.constexpr, X_PER_PAIR: tl.constexpr,
                            HAS_BIAS: tl.constexpr, RELU2: tl.constexpr, DOT_F32: tl.constexpr,
                            T_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            K_ITERS: tl.constexpr):
    """``_pair_gemv_kernel``'s outputs with each distinct expert's tile read once. Pairs are
    keyed by (expert, how often that expert came earlier in the same token: 0 for top-k
    routing), so a key has at most one pair per token. Program (p, nb) returns unless p is
    the first pair of its key (the leader); the leader multiplies one x row per token (that
    token's pair of the key, or zeros; T_BLOCK >= TOKENS rows) by one weight tile per K block
    with ``tl.dot`` and stores those pairs' rows, in pair order. No sort, no host read.
    The key search runs over one slot column at a time, without reductions over the slots
    (the interpreter's ``tl.reduce`` is an element-wise Python loop). DOT_F32 runs the dot on
    fp32 tiles in IEEE precision (the interpreter, whose bf16 dot is broken, and fp32
    weights, which would otherwise get TF32)."""
    p = tl.program_id(0)
    e32 = tl.load(IDS + p)
    occ_p = p * 0
    for jj in tl.static_range(TOPK):
        occ_p += ((tl.load(IDS + (p // TOPK) * TOPK + jj) == e32) & (jj < p % TOPK)).to(tl.int32)
    t = tl.arange(0, T_BLOCK)
    tm = t < TOKENS
    first = tl.full([T_BLOCK], 1 << 30, tl.int32)       # each token's pair of p's key
    for jj in tl.static_range(TOPK):
        col = tl.load(IDS + t * TOPK + jj, mask=tm, other=-1)
        occ = t * 0
        for j2 in tl.static_range(jj):
            occ += (tl.load(IDS + t * TOPK + j2, mask=tm, other=-1) == col).to(tl.int32)
        first = tl.where(tm & (col == e32) & (occ == occ_p), t * TOPK + jj, first)
    if tl.reduce(first, 0, _min_fn) != p:
        return
    has = first < (1 << 30)
    e = e32.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    rows = first.to(tl.int64) if X_PER_PAIR else t.to(tl.int64)
    acc = tl.full([T_BLOCK, BLOCK_N], 0.0, tl.float32)
    for it in range(K_ITERS):      # a constexpr trip count (the interpreter needs one)
        k = it * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(X + rows[:, None] * s_x + k[None, :], mask=has[:, None] & km[None, :],
                    other=0.0)
        w = tl.load(W + e * s_we + n[:, None].to(tl.int64) * s_wn + k[None, :],
                    mask=nm[:, None] & km[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:      # both 16-bit of one dtype (the launcher checks): fp32 accumulation
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc = acc + tl.load(B + e * N + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = acc.to(Y.dtype.element_ty)
    if RELU2:
        yf = tl.maximum(y.to(tl.float32), 0.0)
        y = (yf * yf).to(Y.dtype.element_ty)
    tl.store(Y + first[:, None].to(tl.int64) * s_y + n[None, :], y,
             mask=has[:, None] & nm[None, :])
