"""Triton kernel of the skinny GEMM (``kernels/skinny_gemm.py`` has the launcher)."""
import triton
import triton.language as tl


@triton.jit
def _add_fn(a, b):
    return a + b


@triton.jit
def _skinny_gemm_kernel(X, W, B, Y, M, N, K, s_xm, s_wn, s_ym,
                        M_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr):
    """Columns [nb * BLOCK_N, ...) of y = x W^T (+ b) for all M <= M_BLOCK rows of x: the
    weight tile is read once for every row; products and sums in fp32 (inputs widened in
    registers), rounded once to Y's dtype."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, M_BLOCK)
    mm = m < M
    acc = tl.full([M_BLOCK, BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for it in range(K_ITERS):      # a constexpr trip count (the interpreter needs one)
        k = it * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < K
        w = tl.load(W + n[:, None].to(tl.int64) * s_wn + k[None, :],
                    mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + m[:, None] * s_xm + k[None, :], mask=mm[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    y = tl.reduce(acc, 2, _add_fn)
    if HAS_BIAS:
        y = y + tl.load(B + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * s_ym + n[None, :], y.to(Y.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])
