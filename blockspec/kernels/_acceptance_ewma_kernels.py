"""Triton kernel of the acceptance EWMA's per-step update (``kernels/acceptance_ewma.py`` has
the launcher; the reference is ``AcceptanceEWMA.update_reference``). One program holds the
whole batch: the engine row is a sum over the rows, and every row is read before any is
written."""
import triton
import triton.language as tl


@triton.jit
def _ewma_update_kernel(TABLE, ENGINE, SLOT, CTR, ACC, OUT, B, P, width, dummy, alpha,
                        engine_alpha, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    rb = tl.arange(0, BLOCK_B)
    jp = tl.arange(0, BLOCK_P)
    b = rb[:, None]
    j = jp[None, :]
    bm = b < B
    m = bm & (j < P)
    slot = tl.load(SLOT + b, mask=bm, other=0).to(tl.int64)
    ctr = tl.load(CTR + b, mask=bm, other=1)
    a = tl.load(ACC + b, mask=bm, other=0)
    eng = tl.load(ENGINE + jp, mask=jp < P, other=0.0)
    row = tl.load(TABLE + slot * P + j, mask=m, other=0.0)
    prev = tl.where(ctr == 0, eng[None, :], row)
    tested = (j <= a) & (j < width - 1)
    hit = (j < a).to(tl.float32)
    new = tl.where(tested, prev + alpha * (hit - prev), prev)
    tl.store(TABLE + slot * P + j, new, mask=m)
    seen = (tested & (slot != dummy) & m).to(tl.float32)
    n = tl.reduce(seen, 0, tl.standard._sum_combine)
    hits = tl.reduce(hit * seen, 0, tl.standard._sum_combine)
    rate = hits / tl.maximum(n, 1.0)
    eng = tl.where(n > 0, eng + engine_alpha * (rate - eng), eng)
    tl.store(ENGINE + jp, eng, mask=jp < P)
    out = OUT + b.to(tl.int64) * (2 * P) + j
    tl.store(out, new.to(tl.float64), mask=m)
    tl.store(out + P, (new * 0.0 + eng[None, :]).to(tl.float64), mask=m)
