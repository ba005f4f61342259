"""Triton kernels of the chunked SSD scan of a Mamba-2 prefill (``kernels/ssd_scan.py`` has the
launcher; ``layers/mamba2.ssd_chunked_scan`` is the torch reference).

Four launches, each parallel over (request, chunk or not, head, tile):
(a) ``_chunk_cumsum_kernel``: the cumulative sum of dt * A inside every chunk;
(b) ``_chunk_state_kernel``: each chunk's own contribution to the state,
    B^T (exp(a_last - a_s) * dt_s * x_s), as if it had started from zero;
(c) ``_state_passing_kernel``: the states at the chunk boundaries, sequential over chunks from
    the request's committed state, S_{c+1} = exp(a_last(c)) * S_c + contribution(c);
(d) ``_chunk_scan_kernel``: the outputs, y = exp(a_l) C_l S_c + sum_{s<=l} (C_l . B_s)
    exp(a_l - a_s) dt_s x_s, both matmuls as ``tl.dot``.
All math is fp32 whatever the input dtype; the dots take fp32 operands at PRECISION.
B and C are per group: head h reads group h // (H // G).
"""
import triton
import triton.language as tl


@triton.jit
def _chunk_cumsum_kernel(DT, A, ACS, T, s_db, s_dt, s_dh, s_ab, s_ah, s_ac,
                         H: tl.constexpr, Q: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    """Program (request * chunk, block of heads): ACS[b, h, c, l] = sum_{s<=l} dt[c*Q+s] * A[h]
    for the chunk's positions l (positions past T count zero)."""
    bc = tl.program_id(0)
    nchunks = (T + Q - 1) // Q
    b = (bc // nchunks).to(tl.int64)
    c = bc % nchunks
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    l = tl.arange(0, BLOCK_Q)
    pos = c * Q + l
    hm = h < H
    m = (l < Q)[:, None] & (pos < T)[:, None] & hm[None, :]
    dt = tl.load(DT + b * s_db + pos[:, None].to(tl.int64) * s_dt + h[None, :] * s_dh, mask=m,
                 other=0.0).to(tl.float32)
    a = tl.load(A + h, mask=hm, other=0.0).to(tl.float32)
    # tl.standard's sum combine: numpy's cumsum in the interpreter (see triton_loader)
    acs = tl.associative_scan(dt * a[None, :], 0, tl.standard._sum_combine)
    tl.store(ACS + b * s_ab + h[None, :] * s_ah + c * s_ac + l[:, None], acs,
             mask=(l < Q)[:, None] & hm[None, :])


@triton.jit
def _chunk_state_kernel(X, DT, B, ACS, STATES, T,
                        s_xb, s_xt, s_xh, s_xp, s_db, s_dt, s_dh, s_bb, s_bt, s_bg, s_bn,
                        s_ab, s_ah, s_ac, s_sb, s_sc, s_sh, s_sp,
                        H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                        Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (request * chunk, head, (P, N) tile): the chunk's contribution
    sum_s x[s, p] * exp(a_last - a_s) * dt_s * B[s, n], written to STATES[b, c + 1, h]
    (the state passing turns it into the state after the chunk)."""
    bc = tl.program_id(0)
    h = tl.program_id(1)
    nchunks = (T + Q - 1) // Q
    b = (bc // nchunks).to(tl.int64)
    c = bc % nchunks
    g = h // (H // G)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    p = (tl.program_id(2) // tiles_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(2) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    length = tl.minimum(T - c * Q, Q)
    acs = ACS + b * s_ab + h * s_ah + c * s_ac
    a_last = tl.load(acs + length - 1)
    acc = tl.full([BLOCK_P, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, Q, BLOCK_K):         # a constexpr trip count (the interpreter needs one)
        s = k0 + tl.arange(0, BLOCK_K)
        sm = s < length
        pos = (c * Q + s).to(tl.int64)
        dt = tl.load(DT + b * s_db + pos * s_dt + h * s_dh, mask=sm, other=0.0).to(tl.float32)
        a_s = tl.load(acs + s, mask=sm, other=0.0)
        scale = tl.where(sm, tl.exp(a_last - a_s) * dt, 0.0)
        xt = tl.load(X + b * s_xb + pos[None, :] * s_xt + h * s_xh + p[:, None] * s_xp,
                     mask=sm[None, :] & (p < P)[:, None], other=0.0).to(tl.float32)
        bm = tl.load(B + b * s_bb + pos[:, None] * s_bt + g * s_bg + n[None, :] * s_bn,
                     mask=sm[:, None] & (n < N)[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(xt * scale[None, :], bm, acc, input_precision=PRECISION)
    out = STATES + b * s_sb + (c + 1).to(tl.int64) * s_sc + h * s_sh
    tl.store(out + p[:, None] * s_sp + n[None, :], acc, mask=(p < P)[:, None] & (n < N)[None, :])


@triton.jit
def _state_passing_kernel(STATE0, ACS, STATES, T,
                          s_0b, s_0h, s_0p, s_0n, s_ab, s_ah, s_ac, s_sb, s_sc, s_sh, s_sp,
                          N: tl.constexpr, PN: tl.constexpr, Q: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Program (request, head, block of the P*N state entries): STATES[b, 0] = the committed
    state, then for every chunk c in order STATES[b, c+1] = exp(a_last(c)) * STATES[b, c] +
    (the chunk's contribution, which STATES[b, c+1] holds on entry)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = i < PN
    p = i // N
    n = i % N
    state = tl.load(STATE0 + b * s_0b + h * s_0h + p * s_0p + n * s_0n, mask=m,
                    other=0.0).to(tl.float32)
    base = STATES + b * s_sb + h * s_sh + p * s_sp + n
    tl.store(base, state, mask=m)
    nchunks = (T + Q - 1) // Q
    c = 0
    while c < nchunks:                      # the interpreter cannot run a for over a runtime bound
        length = tl.minimum(T - c * Q, Q)
        decay = tl.exp(tl.load(ACS + b * s_ab + h * s_ah + c * s_ac + length - 1))
        ptr = base + (c + 1).to(tl.int64) * s_sc
        state = decay * state + tl.load(ptr, mask=m, other=0.0)
        tl.store(ptr, state, mask=m)
        c += 1


@triton.jit
def _chunk_scan_kernel(X, DT, B, C, ACS, STATES, Y, T,
                       s_xb, s_xt, s_xh, s_xp, s_db, s_dt, s_dh, s_bb, s_bt, s_bg, s_bn,
                       s_cb, s_ct, s_cg, s_cn, s_ab, s_ah, s_ac, s_sb, s_sc, s_sh, s_sp,
                       s_yb, s_yt, s_yh, s_yp,
                       H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                       Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (request * chunk, head, (rows, P) tile): for the chunk's positions l in the tile,
    y[l] = exp(a_l) * C_l S_c + sum_{s<=l} (C_l . B_s) exp(a_l - a_s) dt_s x_s, where S_c is
    the state entering the chunk (STATES[b, c]). BLOCK_N covers all of N: C's tile is loaded
    once and serves both terms."""
    bc = tl.program_id(0)
    h = tl.program_id(1)
    nchunks = (T + Q - 1) // Q
    b = (bc // nchunks).to(tl.int64)
    c = bc % nchunks
    g = h // (H // G)
    tiles_p = (P + BLOCK_P - 1) // BLOCK_P
    m0 = (tl.program_id(2) // tiles_p) * BLOCK_M
    l = m0 + tl.arange(0, BLOCK_M)
    p = (tl.program_id(2) % tiles_p) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    length = tl.minimum(T - c * Q, Q)
    lm = l < length
    pm = p < P
    nm = n < N
    acs = ACS + b * s_ab + h * s_ah + c * s_ac
    a_l = tl.load(acs + l, mask=lm, other=0.0)
    lpos = (c * Q + l).to(tl.int64)
    cm = tl.load(C + b * s_cb + lpos[:, None] * s_ct + g * s_cg + n[None, :] * s_cn,
                 mask=lm[:, None] & nm[None, :], other=0.0).to(tl.float32)

    # the state entering the chunk, read as S^T [N, P]
    st = tl.load(STATES + b * s_sb + c.to(tl.int64) * s_sc + h * s_sh + p[None, :] * s_sp
                 + n[:, None], mask=nm[:, None] & pm[None, :], other=0.0)
    acc = tl.dot(cm, st, input_precision=PRECISION)
    acc = acc * tl.where(lm, tl.exp(a_l), 0.0)[:, None]

    # within the chunk: causal, so only source blocks that start before the tile's end
    for k0 in range(0, Q, BLOCK_K):
        if (k0 < m0 + BLOCK_M) & (k0 < length):
            s = k0 + tl.arange(0, BLOCK_K)
            sm = s < length
            spos = (c * Q + s).to(tl.int64)
            bt = tl.load(B + b * s_bb + spos[None, :] * s_bt + g * s_bg + n[:, None] * s_bn,
                         mask=nm[:, None] & sm[None, :], other=0.0).to(tl.float32)
            cb = tl.dot(cm, bt, input_precision=PRECISION)                  # [M, K]
            a_s = tl.load(acs + s, mask=sm, other=0.0)
            dt = tl.load(DT + b * s_db + spos * s_dt + h * s_dh, mask=sm,
                         other=0.0).to(tl.float32)
            causal = (s[None, :] <= l[:, None]) & sm[None, :] & lm[:, None]
            # mask before exp: above the diagonal a_l - a_s > 0 could overflow
            decay = tl.exp(tl.where(causal, a_l[:, None] - a_s[None, :], float("-inf")))
            xs = tl.load(X + b * s_xb + spos[:, None] * s_xt + h * s_xh + p[None, :] * s_xp,
                         mask=sm[:, None] & pm[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(cb * decay * dt[None, :], xs, acc, input_precision=PRECISION)
    tl.store(Y + b * s_yb + lpos[:, None] * s_yt + h * s_yh + p[None, :] * s_yp, acc,
             mask=lm[:, None] & pm[None, :])
