"""Triton kernel of the greedy DSpark Markov walk (``kernels/markov_walk.py`` has the launcher
and the layout of the work)."""
import triton
import triton.language as tl


@triton.jit
def _argmax_fn(av, ai, bv, bi):
    """Larger value wins; equal values keep the smaller index (torch.argmax's first maximum)."""
    take_a = (av > bv) | ((av == bv) & (ai < bi))
    return tl.where(take_a, av, bv), tl.where(take_a, ai, bi)


@triton.jit
def _markov_slot_kernel(BASE, W1, W2, ANCHOR, PV, PI, TOK, k, V, R, NB, GAMMA,
                        s_bb, s_bk, s_w1, s_w2,
                        BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_NB: tl.constexpr,
                        FINAL: tl.constexpr):
    """Program (row b, vocabulary block vb) of slot k.

    First the previous token: the anchor at slot 0, else the argmax over the NB partial maxima
    slot k-1 left (every program reduces them itself, so no second launch sits between slots;
    program vb = 0 also stores it). Then this block's columns of the corrected logits
    base[b, k] + W2 · W1[prev] and their partial maximum. ``FINAL`` launches only store the
    last slot's token."""
    b = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1)
    if k == 0:
        prev = tl.load(ANCHOR + b).to(tl.int64)
    else:
        j = tl.arange(0, BLOCK_NB)
        jm = j < NB
        part = (b * GAMMA + k - 1) * NB + j
        pv = tl.load(PV + part, mask=jm, other=float("-inf"))
        pi = tl.load(PI + part, mask=jm, other=2147483647)
        best_v, best_i = tl.reduce((pv, pi), 0, _argmax_fn)
        prev = best_i.to(tl.int64)
        if vb == 0:
            tl.store(TOK + b * GAMMA + k - 1, prev)
    if not FINAL:
        r = tl.arange(0, BLOCK_R)
        rm = r < R
        e = tl.load(W1 + prev * s_w1 + r, mask=rm, other=0.0).to(W2.dtype.element_ty).to(tl.float32)
        cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        cm = cols < V
        w = tl.load(W2 + cols[:, None].to(tl.int64) * s_w2 + r[None, :],
                    mask=cm[:, None] & rm[None, :], other=0.0).to(tl.float32)
        # rounded to the weight dtype as the linear layer's output is; tl.standard's sum combine:
        # the same code as a local one when compiled, and the interpreter sums it with numpy
        bias = tl.reduce(w * e[None, :], 1, tl.standard._sum_combine)
        bias = bias.to(W2.dtype.element_ty).to(tl.float32)
        logit = tl.load(BASE + b * s_bb + k * s_bk + cols, mask=cm, other=0.0).to(tl.float32) + bias
        logit = tl.where(cm, logit, float("-inf"))
        best_v, best_i = tl.reduce((logit, cols), 0, _argmax_fn)
        tl.store(PV + (b * GAMMA + k) * NB + vb, best_v)
        tl.store(PI + (b * GAMMA + k) * NB + vb, best_i)
