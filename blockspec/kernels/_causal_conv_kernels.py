"""Triton kernel of the causal depthwise conv of a Mamba-2 prefill (``kernels/causal_conv.py``
has the launcher; ``Mamba2Mixer._conv`` is the torch reference)."""
import triton
import triton.language as tl


@triton.jit
def _causal_conv_kernel(XBC, WIN, W, BIAS, OUT, NEW_WIN, T, C,
                        s_xb, s_xt, s_wb, s_wc, s_wk, s_ob, s_ot, s_nb, s_nc, s_nk,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """Program (request, block of positions, block of channels):
    OUT[b, t, c] = silu(bias[c] + sum_k W[c, k] * full[c, t + k]) over full = [window | xbc]
    (the window's K - 1 columns are the inputs before position 0), in fp32, rounded once to
    OUT's dtype. Window columns are first rounded to XBC's dtype, as the reference concatenates
    them. The position block 0 also writes NEW_WIN = the last K - 1 columns of full."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm = t < T
    cm = c < C
    acc = tl.full([BLOCK_T, BLOCK_C], 0.0, tl.float32)
    for k in tl.static_range(K):
        src = t - (K - 1) + k                    # position in xbc; < 0: window column K-1+src
        from_x = src >= 0
        m = tm[:, None] & cm[None, :]
        xv = tl.load(XBC + b * s_xb + src[:, None].to(tl.int64) * s_xt + c[None, :],
                     mask=m & from_x[:, None], other=0.0)
        wv = tl.load(WIN + b * s_wb + c[None, :] * s_wc + (src[:, None] + K - 1) * s_wk,
                     mask=m & (src < 0)[:, None], other=0.0).to(XBC.dtype.element_ty)
        wk = tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)
        acc += tl.where(from_x[:, None], xv, wv).to(tl.float32) * wk[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(OUT + b * s_ob + t[:, None].to(tl.int64) * s_ot + c[None, :],
             out.to(OUT.dtype.element_ty), mask=tm[:, None] & cm[None, :])
    if tl.program_id(1) == 0:
        for j in tl.static_range(K - 1):
            q = T + j                            # column of full = [window (K-1) | xbc (T)]
            old = tl.load(WIN + b * s_wb + c * s_wc + q * s_wk, mask=cm & (q < K - 1),
                          other=0.0)
            new = tl.load(XBC + b * s_xb + (q - (K - 1)) * s_xt + c, mask=cm & (q >= K - 1),
                          other=0.0)
            new = tl.where(q >= K - 1, new.to(NEW_WIN.dtype.element_ty),
                           old.to(NEW_WIN.dtype.element_ty))
            tl.store(NEW_WIN + b * s_nb + c * s_nc + j * s_nk, new, mask=cm)
