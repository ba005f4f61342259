"""Triton kernel of the MoE router logits (``kernels/router_gemv.py`` has the launcher)."""
import triton
import triton.language as tl


@triton.jit
def _router_gemv_kernel(X, W, OUT, T, E, H, s_x, s_o, s_s,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        K_ITERS: tl.constexpr):
    """OUT[s, t, e] = sum over split s's columns of float(X[t, k]) * W[e, k] for the BLOCK_T
    tokens of program_id(1), the BLOCK_E experts of program_id(0) and the K split
    s = program_id(2) (columns [s * K_ITERS * BLOCK_K, (s + 1) * K_ITERS * BLOCK_K)), in fp32.
    Each weight element of the block is read once and used for all BLOCK_T tokens. The products accumulate elementwise in a
    [BLOCK_T, BLOCK_E, BLOCK_K] tile over the K_ITERS column chunks (no reduction inside the
    loop) and are summed along K once at the end: a fixed order, so results are the same run
    to run. W is [E, H] contiguous fp32; X rows are s_x apart, columns contiguous.

    Both loads are of the whole [BLOCK_T, BLOCK_E, BLOCK_K] tile (x repeated along the
    experts, w along the tokens; the repeats are L1 hits), so the compiler gives them and the
    accumulator one layout. Loads of [BLOCK_T, 1, BLOCK_K] and [1, BLOCK_E, BLOCK_K] get two
    (their sizes differ, and bf16 vectors hold 8 elements where fp32 ones hold 4), and one
    of them then goes through shared memory with barriers in every chunk (sm_90 PTX, checked
    offline: 4-15 bar.sync and 2-4 KB of shared memory against 1-4 now, only around the
    final reduction and the store)."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(2)
    k = split * (K_ITERS * BLOCK_K) + tl.arange(0, BLOCK_K)[None, None, :]
    em = (e < E)[None, :, None]
    tm = (t < T)[:, None, None]
    x_rows = tl.broadcast_to(X + t.to(tl.int64)[:, None, None] * s_x, [BLOCK_T, BLOCK_E, 1])
    w_rows = tl.broadcast_to(W + e.to(tl.int64)[None, :, None] * H, [BLOCK_T, BLOCK_E, 1])
    xm = tl.broadcast_to(tm, [BLOCK_T, BLOCK_E, 1])
    wm = tl.broadcast_to(em, [BLOCK_T, BLOCK_E, 1])
    acc = tl.full([BLOCK_T, BLOCK_E, BLOCK_K], 0.0, tl.float32)
    for i in range(K_ITERS):
        kk = i * BLOCK_K + k
        km = kk < H
        xv = tl.load(x_rows + kk, mask=xm & km, other=0.0).to(tl.float32)
        wv = tl.load(w_rows + kk, mask=wm & km, other=0.0).to(tl.float32)
        acc += xv * wv
    # tl.standard's sum combine (not a local one): identical code when compiled, and the
    # interpreter recognises it and sums with numpy instead of one Python call per element
    out = tl.reduce(acc, 2, tl.standard._sum_combine)
    tl.store(OUT + split.to(tl.int64) * s_s + t.to(tl.int64)[:, None] * s_o + e[None, :], out,
             mask=(t < T)[:, None] & (e < E)[None, :])
