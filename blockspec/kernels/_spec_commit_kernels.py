"""Triton kernel of a speculative step's bookkeeping after acceptance
(``kernels/spec_commit.py`` has the launcher; the reference is
``SpecWorker.commit_reference``). One program holds the whole batch: the EWMA's engine row is
a sum over the rows, and every row is read before any is written."""
import triton
import triton.language as tl


@triton.jit
def _spec_commit_kernel(ACC, BONUS, DRAFTS, SLOT, CTR, TOKEN, PREFIX, SCTR, TABLE, ENGINE,
                        ENGINE_N, ENDED, OUT, TOKS, STOP, B, s_d, dummy, alpha, engine_alpha,
                        engine_prior_n, T: tl.constexpr,
                        G: tl.constexpr, HAS_EWMA: tl.constexpr, N_STOP: tl.constexpr,
                        BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    rb = tl.arange(0, BLOCK_B)
    bm1 = rb < B
    b = rb[:, None]
    bm = b < B
    a1 = tl.load(ACC + rb, mask=bm1, other=0).to(tl.int64)
    bonus1 = tl.load(BONUS + rb, mask=bm1, other=0).to(tl.int64)
    slot1 = tl.load(SLOT + rb, mask=bm1, other=0).to(tl.int64)
    ctr1 = tl.load(CTR + rb, mask=bm1, other=1).to(tl.int64)
    a, bonus, slot, ctr = a1[:, None], bonus1[:, None], slot1[:, None], ctr1[:, None]
    C = 1 + 2 * T + 2 * G
    row_out = OUT + b.to(tl.int64) * C

    # committed tokens: the drafts with the bonus at the accept length (and last)
    jt = tl.arange(0, BLOCK_T)[None, :]
    mt = bm & (jt < T)
    d = tl.load(DRAFTS + b.to(tl.int64) * s_d + jt, mask=bm & (jt < T - 1), other=0)
    tok = tl.where(jt == a, bonus, tl.where(jt < T - 1, d.to(tl.int64), bonus))
    tl.store(TOKS + b.to(tl.int64) * T + jt, tok, mask=mt)
    tl.store(OUT + rb.to(tl.int64) * C, a1.to(tl.float64), mask=bm1)
    tl.store(row_out + 1 + jt, tok.to(tl.float64), mask=mt)
    tl.store(row_out + 1 + T + jt, (tok * 0).to(tl.float64), mask=mt)   # logprobs: later

    # the acceptance EWMA (AcceptanceEWMA.update): rows, then the engine row in every row
    jg1 = tl.arange(0, BLOCK_G)
    jg = jg1[None, :]
    mg = bm & (jg < G)
    if HAS_EWMA:
        # the engine row first (the running mean of every observation, the prior counting as
        # engine_prior_n, until a step weighs less than engine_alpha), then the rows: a
        # request's first step starts from the engine row as this step leaves it
        tested = (jg <= a) & (jg < T - 1)
        # a row whose request has committed an end-of-sequence id (STOP), in this step or
        # in an earlier one, observes nothing
        stopped = tok * 0
        for s in tl.static_range(N_STOP):
            stopped = stopped | ((tok == tl.load(STOP + s).to(tl.int64)) & (jt <= a)).to(tl.int64)
        was = tl.load(ENDED + slot1, mask=bm1, other=0)
        ended = (tl.reduce(stopped, 1, tl.standard._sum_combine) > 0) | ((was != 0) & (ctr1 != 0))
        tl.store(ENDED + slot1, ended.to(tl.int32), mask=bm1)
        tested = tested & (ended[:, None] == 0)
        hit = (jg < a).to(tl.float32)
        seen = (tested & (slot != dummy) & mg).to(tl.float32)
        n = tl.reduce(seen, 0, tl.standard._sum_combine)
        hits = tl.reduce(hit * seen, 0, tl.standard._sum_combine)
        rate = hits / tl.maximum(n, 1.0)
        eng = tl.load(ENGINE + jg1, mask=jg1 < G, other=0.0)
        eng_n = tl.load(ENGINE_N + jg1, mask=jg1 < G, other=0.0) + n
        weight = tl.maximum(n / (eng_n + engine_prior_n), engine_alpha)
        eng = tl.where(n > 0, eng + weight * (rate - eng), eng)
        tl.store(ENGINE + jg1, eng, mask=jg1 < G)
        tl.store(ENGINE_N + jg1, eng_n, mask=jg1 < G)
        row = tl.load(TABLE + slot * G + jg, mask=mg, other=0.0)
        prev = tl.where(ctr == 0, eng[None, :], row)
        new = tl.where(tested, prev + alpha * (hit - prev), prev)
        tl.store(TABLE + slot * G + jg, new, mask=mg)
        tl.store(row_out + 1 + 2 * T + jg, new.to(tl.float64), mask=mg)
        tl.store(row_out + 1 + 2 * T + G + jg, (new * 0.0 + eng[None, :]).to(tl.float64),
                 mask=mg)
    else:
        zero = (jg * 0).to(tl.float64)
        tl.store(row_out + 1 + 2 * T + jg, zero, mask=mg)
        tl.store(row_out + 1 + 2 * T + G + jg, zero, mask=mg)

    # the same requests' next inputs (ModelRunner.advance_inputs); padding rows stay
    live = slot1 != dummy
    n_rows = tl.where(live, a1 + 1, 0)
    old = tl.load(TOKEN + rb, mask=bm1, other=0)
    tl.store(TOKEN + rb, tl.where(live, bonus1, old), mask=bm1)
    tl.store(PREFIX + rb, tl.load(PREFIX + rb, mask=bm1, other=0) + n_rows, mask=bm1)
    tl.store(SCTR + rb, tl.load(SCTR + rb, mask=bm1, other=0) + n_rows, mask=bm1)
    tl.store(CTR + rb, ctr1 + live.to(tl.int64), mask=bm1)
