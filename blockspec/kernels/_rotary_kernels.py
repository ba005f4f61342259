"""Triton kernel of the fused NeoX rotary embedding (``kernels/rotary.py`` has the launcher; the
torch reference is ``kernels/rotary.apply_rotary_reference``)."""
import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # The interpreter runs tl.cos/tl.sin as numpy's fp32 cos/sin; it cannot call libdevice.
    @triton.jit
    def _cos_sin(a):
        return tl.cos(a), tl.sin(a)
else:
    from triton.language.extra.cuda import libdevice

    # libdevice's cosf/sinf do the full range reduction, as the CUDA cos/sin torch's reference
    # runs; angles here reach tens of thousands of radians, where an approximate
    # hardware sin/cos would be far off.
    @triton.jit
    def _cos_sin(a):
        return libdevice.cos(a), libdevice.sin(a)


@triton.jit
def _rotary_kernel(X, P, F, Y, heads, half, s_xn, s_xh,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (row, block of heads): the angles pos * inv_freq and their cos/sin once per row,
    then every head's pairs (x[i], x[i + d/2]) rotated in fp32 and stored in Y's dtype.
    Y is contiguous [rows, heads, 2 * half]; X only needs a contiguous last dim."""
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    i = tl.arange(0, BLOCK_D)
    mi = i < half
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = h < heads
    angle = tl.load(P + row).to(tl.float32) * tl.load(F + i, mask=mi, other=0.0)
    c, s = _cos_sin(angle)
    c = c[None, :]
    s = s[None, :]
    m = mh[:, None] & mi[None, :]
    x_off = row * s_xn + h[:, None].to(tl.int64) * s_xh + i[None, :]
    x1 = tl.load(X + x_off, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_off + half, mask=m, other=0.0).to(tl.float32)
    # The reference's order of operations (two products, then the sum), so that with FMA
    # contraction off the fp32 results round as torch's do.
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    y_off = row * (heads * 2 * half) + h[:, None].to(tl.int64) * (2 * half) + i[None, :]
    tl.store(Y + y_off, y1.to(Y.dtype.element_ty), mask=m)
    tl.store(Y + y_off + half, y2.to(Y.dtype.element_ty), mask=m)
