"""Triton kernel of the Mamba-2 recurrent steps (``kernels/mamba_step.py`` has the launcher
and the torch reference it is tested against)."""
import triton
import triton.language as tl


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _conv_step(w0, w1, w2, w3, bias, v0, v1, v2, new):
    """Depthwise width-4 causal conv at one step: oldest input times w0 ... newest times w3."""
    return _silu(bias + w0 * v0 + w1 * v1 + w2 * v2 + w3 * new)


@triton.jit
def _mamba_steps_kernel(
        ZXBCDT, CONV_W, CONV_B, DT_BIAS, A_LOG, D_SKIP, CONV_STATE, SSM_STATE, SLOTS, Y,
        STEP_SCRATCH, XBC_SCRATCH,
        s_xr, s_dr, s_cs, s_ss, s_sss, s_sst, s_xss, s_xst, s_y,
        dt_lo, dt_hi,
        T: tl.constexpr, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
        DINNER: tl.constexpr, CONV: tl.constexpr, BLOCK_P: tl.constexpr, COMMIT: tl.constexpr,
        HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr):
    """Program (request b, head h, block of BLOCK_P head channels): T recurrent steps from the
    committed state of slot SLOTS[b].

    Rows of ZXBCDT (the in_proj output z | x B C | dt) are (b * T + t); the conv channels start
    at column DINNER, the raw dt at DINNER + CONV.
    COMMIT (decode): the final SSM state is written back to the slot (the conv windows by
    ``_conv_window_kernel`` afterwards).
    Otherwise (verify): the committed state is left alone; the pre-conv inputs and each step's
    recurrence inputs (decay exp(dt * a) per head, dt * x per channel, B per group: columns
    [0, H), [H, H + DINNER), [H + DINNER, + G * N) of STEP_SCRATCH) go to the verify scratch
    of the slot, from which ``_commit_verify_kernel`` replays the accepted steps (a row of
    inputs is 1/N of the state it replaces).
    Every update is fma(state, decay, dt * x * B), written out so that decode, verify and
    commit round alike whatever the compiler would contract.
    Y[row, h*P + p] = C . state + D * x (fp32).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    XBC = ZXBCDT + DINNER
    DT = ZXBCDT + DINNER + CONV
    slot = tl.load(SLOTS + b).to(tl.int64)
    g = h // (H // G)
    leader = (h % (H // G) == 0) & (pb == 0)      # writes the group's B / C scratch channels
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N)
    xch = h * P + p
    bch = DINNER + g * N + n
    cch = DINNER + G * N + g * N + n
    a = -tl.exp(tl.load(A_LOG + h).to(tl.float32))
    dskip = tl.load(D_SKIP + h).to(tl.float32)
    dtb = tl.load(DT_BIAS + h).to(tl.float32)

    # conv weights [C, 4] and the committed windows (oldest first) of the three channel sets
    wx0 = tl.load(CONV_W + xch * 4 + 0).to(tl.float32)
    wx1 = tl.load(CONV_W + xch * 4 + 1).to(tl.float32)
    wx2 = tl.load(CONV_W + xch * 4 + 2).to(tl.float32)
    wx3 = tl.load(CONV_W + xch * 4 + 3).to(tl.float32)
    wb0 = tl.load(CONV_W + bch * 4 + 0).to(tl.float32)
    wb1 = tl.load(CONV_W + bch * 4 + 1).to(tl.float32)
    wb2 = tl.load(CONV_W + bch * 4 + 2).to(tl.float32)
    wb3 = tl.load(CONV_W + bch * 4 + 3).to(tl.float32)
    wc0 = tl.load(CONV_W + cch * 4 + 0).to(tl.float32)
    wc1 = tl.load(CONV_W + cch * 4 + 1).to(tl.float32)
    wc2 = tl.load(CONV_W + cch * 4 + 2).to(tl.float32)
    wc3 = tl.load(CONV_W + cch * 4 + 3).to(tl.float32)
    if HAS_BIAS:
        bx = tl.load(CONV_B + xch).to(tl.float32)
        bb = tl.load(CONV_B + bch).to(tl.float32)
        bc = tl.load(CONV_B + cch).to(tl.float32)
    else:
        bx = tl.full([BLOCK_P], 0.0, tl.float32)
        bb = tl.full([N], 0.0, tl.float32)
        bc = tl.full([N], 0.0, tl.float32)
    cs = CONV_STATE + slot * s_cs
    vx0 = tl.load(cs + xch * 3 + 0).to(tl.float32)
    vx1 = tl.load(cs + xch * 3 + 1).to(tl.float32)
    vx2 = tl.load(cs + xch * 3 + 2).to(tl.float32)
    vb0 = tl.load(cs + bch * 3 + 0).to(tl.float32)
    vb1 = tl.load(cs + bch * 3 + 1).to(tl.float32)
    vb2 = tl.load(cs + bch * 3 + 2).to(tl.float32)
    vc0 = tl.load(cs + cch * 3 + 0).to(tl.float32)
    vc1 = tl.load(cs + cch * 3 + 1).to(tl.float32)
    vc2 = tl.load(cs + cch * 3 + 2).to(tl.float32)

    sptr = SSM_STATE + slot * s_ss + (h * P + p)[:, None] * N + n[None, :]
    state = tl.load(sptr)
    for t in tl.static_range(T):
        row = (b * T + t).to(tl.int64)
        xin = tl.load(XBC + row * s_xr + xch)
        bin_ = tl.load(XBC + row * s_xr + bch)
        cin = tl.load(XBC + row * s_xr + cch)
        if not COMMIT:                               # verify: keep the pre-conv inputs
            xs = XBC_SCRATCH + slot * s_xss + t * s_xst
            tl.store(xs + xch, xin)
            tl.store(xs + bch, bin_, mask=(n < N) & leader)
            tl.store(xs + cch, cin, mask=(n < N) & leader)
        xf, bf, cf = xin.to(tl.float32), bin_.to(tl.float32), cin.to(tl.float32)
        x = _conv_step(wx0, wx1, wx2, wx3, bx, vx0, vx1, vx2, xf)
        bv = _conv_step(wb0, wb1, wb2, wb3, bb, vb0, vb1, vb2, bf)
        cv = _conv_step(wc0, wc1, wc2, wc3, bc, vc0, vc1, vc2, cf)
        vx0, vx1, vx2 = vx1, vx2, xf
        vb0, vb1, vb2 = vb1, vb2, bf
        vc0, vc1, vc2 = vc1, vc2, cf
        raw = tl.load(DT + (b * T + t).to(tl.int64) * s_dr + h).to(tl.float32) + dtb
        dt = tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw)))
        if CLAMP:
            dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        decay = tl.exp(dt * a)
        dx = dt * x
        state = tl.fma(state, decay, dx[:, None] * bv[None, :])
        # tl.standard's sum combine: numpy in the interpreter (see triton_loader)
        y = tl.reduce(state * cv[None, :], 1, tl.standard._sum_combine) + dskip * x
        tl.store(Y + row * s_y + h * P + p, y)
        if not COMMIT:
            ss = STEP_SCRATCH + slot * s_sss + t * s_sst
            tl.store(ss + h, decay, mask=pb == 0)
            tl.store(ss + H + xch, dx)
            tl.store(ss + H + DINNER + g * N + n, bv, mask=(n < N) & leader)
    if COMMIT:
        tl.store(sptr, state)


@triton.jit
def _conv_window_kernel(ZXBCDT, CONV_STATE, SLOTS, s_xr, s_cs, DINNER: tl.constexpr,
                        CONV: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr):
    """Decode commit of the conv windows, after the step kernel has read them (a separate
    launch: programs of one group share the B / C channels, so no step program may overwrite
    a window another still reads). New window = the last 3 of [window | inputs of T steps]."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < CONV
    slot = tl.load(SLOTS + b).to(tl.int64)
    cs = CONV_STATE + slot * s_cs + c * 3
    v0 = tl.load(cs + 0, mask=m, other=0.0)
    v1 = tl.load(cs + 1, mask=m, other=0.0)
    v2 = tl.load(cs + 2, mask=m, other=0.0)
    for t in tl.static_range(T):
        row = (b * T + t).to(tl.int64)
        new = tl.load(ZXBCDT + DINNER + row * s_xr + c, mask=m, other=0.0).to(CONV_STATE.dtype.element_ty)
        v0, v1, v2 = v1, v2, new
    tl.store(cs + 0, v0, mask=m)
    tl.store(cs + 1, v1, mask=m)
    tl.store(cs + 2, v2, mask=m)


@triton.jit
def _commit_verify_kernel(SSM, STEPS, CONV, XBC_SCR, SLOTS, INDEX, C,
                          s_sl, s_ss, s_kl, s_ks, s_st, s_cl, s_cs, s_xl, s_xs, s_xt,
                          H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                          W: tl.constexpr, KEEP: tl.constexpr, BLOCK_J: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                          SSM_CHUNKS: tl.constexpr):
    """Program (layer, row, chunk): chunks below SSM_CHUNKS = H * P / BLOCK_P replay steps
    0 .. INDEX[row] of the verify on BLOCK_P channels of one head of the committed SSM state,
    from the step inputs the verify left in STEPS (see ``_mamba_steps_kernel``; the same fma,
    so the result is the verify's state at INDEX bit for bit); the others rebuild BLOCK_C
    channels of the conv window: column j of the new window is column INDEX + 1 + j of
    [old window | the block's pre-conv inputs]."""
    layer = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)
    chunk = tl.program_id(2)
    slot = tl.load(SLOTS + row).to(tl.int64)
    idx = tl.load(INDEX + row).to(tl.int64)
    if chunk < SSM_CHUNKS:
        h = chunk // (P // BLOCK_P)
        p = (chunk % (P // BLOCK_P)) * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        nm = n < N
        sptr = SSM + layer * s_sl + slot * s_ss + (h * P + p)[:, None] * N + n[None, :]
        state = tl.load(sptr, mask=nm[None, :], other=0.0)
        steps = STEPS + layer * s_kl + slot * s_ks
        for t in tl.static_range(W):
            decay = tl.load(steps + t * s_st + h)
            dx = tl.load(steps + t * s_st + H + h * P + p)
            bv = tl.load(steps + t * s_st + H + H * P + (h // (H // G)) * N + n, mask=nm,
                         other=0.0)
            stepped = tl.fma(state, decay, dx[:, None] * bv[None, :])
            state = tl.where(t <= idx, stepped, state)
        tl.store(sptr, state, mask=nm[None, :])
    else:
        c = (chunk - SSM_CHUNKS) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        j = tl.arange(0, BLOCK_J)
        jm = j < KEEP
        q = idx + 1 + j                                   # column in [window | inputs]
        from_old = q[None, :] < KEEP
        old = tl.load(CONV + layer * s_cl + slot * s_cs + c[:, None] * KEEP + q[None, :],
                      mask=cm[:, None] & jm[None, :] & from_old, other=0.0)
        new = tl.load(XBC_SCR + layer * s_xl + slot * s_xs + (q[None, :] - KEEP) * s_xt + c[:, None],
                      mask=cm[:, None] & jm[None, :] & (q[None, :] >= KEEP), other=0.0)
        win = tl.where(from_old, old, new)
        tl.store(CONV + layer * s_cl + slot * s_cs + c[:, None] * KEEP + j[None, :], win,
                 mask=cm[:, None] & jm[None, :])
