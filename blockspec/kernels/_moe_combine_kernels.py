"""Triton kernel of the MoE combine (``kernels/moe_combine.py`` has the launcher)."""
import triton
import triton.language as tl


@triton.jit
def _moe_combine_kernel(Y, INV, W, SHARED, OUT, H, s_y, s_s, s_o, s_part,
                        TOPK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr,
                        SORTED: tl.constexpr, PARTS: tl.constexpr = 1):
    """Token t, columns [hb * BLOCK_H, ...): the weighted sum of its TOPK expert rows (found
    through INV in the expert-sorted outputs Y), rounded to the output dtype, plus the shared
    expert's row (rounded again, as ``routed.to(dtype) + shared`` is). Without SORTED the
    rows are in pair order already (row t * TOPK + j). PARTS > 1: the shared row comes in
    PARTS slices (s_part apart) summed in fp32 and rounded before the add."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cm = c < H
    acc = tl.full([BLOCK_H], 0.0, tl.float32)
    for j in tl.static_range(TOPK):
        if SORTED:
            row = tl.load(INV + t * TOPK + j).to(tl.int64)
        else:
            row = t * TOPK + j
        wj = tl.load(W + t * TOPK + j).to(tl.float32)
        acc += tl.load(Y + row * s_y + c, mask=cm, other=0.0).to(tl.float32) * wj
    out = acc.to(OUT.dtype.element_ty)
    if HAS_SHARED:
        sh = tl.load(SHARED + t * s_s + c, mask=cm, other=0.0).to(tl.float32)
        if PARTS > 1:
            for q in tl.static_range(1, PARTS):
                sh += tl.load(SHARED + t * s_s + q * s_part + c, mask=cm,
                              other=0.0).to(tl.float32)
            sh = sh.to(OUT.dtype.element_ty).to(tl.float32)
        out = (out.to(tl.float32) + sh).to(OUT.dtype.element_ty)
    tl.store(OUT + t * s_o + c, out, mask=cm)
