"""Triton kernel of the per-pair expert GEMV (``kernels/moe_pairs.py`` has the launcher)."""
import triton
import triton.language as tl


@triton.jit
def _add_fn(a, b):
    return a + b


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
    y = tl.reduce(acc, 1, _add_fn)
    if HAS_BIAS:
        y = y + tl.load(B + e * N + n, mask=nm, other=0.0).to(tl.float32)
    y = y.to(Y.dtype.element_ty)
    if RELU2:
        yf = tl.maximum(y.to(tl.float32), 0.0)
        y = (yf * yf).to(Y.dtype.element_ty)
    tl.store(Y + p * s_y + n, y, mask=nm)
