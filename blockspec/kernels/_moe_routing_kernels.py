"""Triton kernels of the fused MoE routing (``kernels/moe_routing.py`` has the launchers; the
torch references are ``route_reference`` and ``sort_by_expert_reference`` in layers/moe.py)."""
import triton
import triton.language as tl

# index of padded or already-taken experts / groups: loses every tie against a real index
_TAKEN = tl.constexpr(1 << 30)


# sums and running sums pass tl.standard's sum combine: the code a local one compiles to, and
# the interpreter sums with numpy instead of one Python call per element (see triton_loader)


@triton.jit
def _argmax_fn(av, ai, bv, bi):
    """(value, index) pairs: the larger value wins, equal values go to the smaller index. A total
    order, so the reduction is associative and its result does not depend on the tree shape."""
    a_wins = (av > bv) | ((av == bv) & (ai < bi))
    return tl.where(a_wins, av, bv), tl.where(a_wins, ai, bi)


@triton.jit
def _logits(ptrs, mask, s_split, SPLITS: tl.constexpr):
    """The logits at ``ptrs`` as the sum of the router's SPLITS partial sums, added in index
    order (``router_gemv.sum_partials`` is the same order)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLITS):
        x += tl.load(ptrs + i * s_split, mask=mask, other=0.0)
    return x


@triton.jit
def _route_kernel(LOGITS, BIAS, IDS, W, s_l, s_split, scale,
                  K: tl.constexpr, N_GROUP: tl.constexpr, GROUP: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, GROUP_TOP: tl.constexpr, NORM: tl.constexpr,
                  SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """One token row. The experts sit in a [group, member] tile (expert = g * GROUP + s), so the
    group-limited selection is a reduction along the members; with one group the tile is a
    single row. Top-k is K rounds of argmax, each taking its winner out of the tile.
    LOGITS holds SPLITS partial sums s_split apart (the router GEMV's K splits)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    s = tl.arange(0, BLOCK_S)[None, :]
    real = (g < N_GROUP) & (s < GROUP)
    expert = g * GROUP + s
    x = _logits(LOGITS + row * s_l + expert, real, s_split, SPLITS)
    bias = tl.load(BIAS + expert, mask=real, other=0.0)
    choice = tl.where(real, 1.0 / (1.0 + tl.exp(-x)) + bias, float("-inf"))
    idx = tl.where(real, expert, _TAKEN)
    if N_GROUP > 1:
        # each group's score: the sum of its GROUP_TOP best choice values
        member, member_idx = choice, idx
        group_score = tl.full([BLOCK_G], 0.0, tl.float32)
        for _ in tl.static_range(GROUP_TOP):
            best, best_idx = tl.reduce((member, member_idx), 1, _argmax_fn)
            group_score += best
            member = tl.where(member_idx == best_idx[:, None], float("-inf"), member)
            member_idx = tl.where(member_idx == best_idx[:, None], _TAKEN, member_idx)
        gi = tl.arange(0, BLOCK_G)
        gidx = tl.where(gi < N_GROUP, gi, _TAKEN)
        keep = tl.full([BLOCK_G], 0, tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            _v, kept = tl.reduce((group_score, gidx), 0, _argmax_fn)
            keep = tl.where(gidx == kept, 1, keep)
            group_score = tl.where(gidx == kept, float("-inf"), group_score)
            gidx = tl.where(gidx == kept, _TAKEN, gidx)
        choice = tl.where(keep[:, None] != 0, choice, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.full([BLOCK_K], 0, tl.int32)
    for j in tl.static_range(K):
        row_best, row_idx = tl.reduce((choice, idx), 1, _argmax_fn)
        _v, best = tl.reduce((row_best, row_idx), 0, _argmax_fn)
        ids = tl.where(kk == j, best, ids)
        choice = tl.where(idx == best, float("-inf"), choice)
        idx = tl.where(idx == best, _TAKEN, idx)
    # the weights are the un-biased scores of the chosen experts (recomputed from their logits)
    live = kk < K
    xk = _logits(LOGITS + row * s_l + ids, live, s_split, SPLITS)
    w = tl.where(live, 1.0 / (1.0 + tl.exp(-xk)), 0.0)
    if NORM:
        w = w / (tl.reduce(w, 0, tl.standard._sum_combine) + 1e-20)
    tl.store(IDS + row * K + kk, ids.to(tl.int64), mask=live)
    tl.store(W + row * K + kk, w * scale, mask=live)


@triton.jit
def _sort_by_expert_kernel(IDS, ORDER, OFFSETS, P, E: tl.constexpr, BLOCK_E: tl.constexpr,
                           CHUNK: tl.constexpr):
    """A stable counting sort in one program, CHUNK pairs at a time. Pass 1 counts the pairs of
    each expert (offsets = their running sum). Pass 2 places every pair at its expert's next free
    slot (the start plus the pairs of that expert in earlier chunks, a running count) plus the
    pairs of that expert earlier in its own chunk (a [CHUNK, CHUNK] comparison)."""
    e = tl.arange(0, BLOCK_E)
    r = tl.arange(0, CHUNK)
    counts = tl.full([BLOCK_E], 0, tl.int32)
    c = 0
    while c * CHUNK < P:
        p = c * CHUNK + r
        ids = tl.load(IDS + p, mask=p < P, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=p < P)
        c += 1
    ends = tl.associative_scan(counts, 0, tl.standard._sum_combine)
    tl.store(OFFSETS + 1 + e, ends.to(tl.int64), mask=e < E)
    tl.store(OFFSETS + e, tl.full([BLOCK_E], 0, tl.int64), mask=e == 0)
    free = ends - counts
    c = 0
    while c * CHUNK < P:
        p = c * CHUNK + r
        live = p < P
        ids = tl.load(IDS + p, mask=live, other=0).to(tl.int32)
        before = (ids[:, None] == ids[None, :]) & (r[None, :] < r[:, None])
        pos = tl.gather(free, ids, 0) + tl.reduce(before.to(tl.int32), 1,
                                                  tl.standard._sum_combine)
        tl.store(ORDER + pos, p.to(tl.int64), mask=live)
        free += tl.histogram(ids, BLOCK_E, mask=live)
        c += 1
