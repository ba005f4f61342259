"""Triton kernel of silu(gate) * up (``kernels/silu_mul.py`` has the launcher)."""
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(GU, Y, inter, s_gu, s_y, BLOCK: tl.constexpr):
    """Program (row, column block): silu of the gate half in fp32, rounded to the input dtype
    as torch's silu is, times the up half in fp32, rounded once more."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < inter
    g = tl.load(GU + row * s_gu + c, mask=m, other=0.0)
    u = tl.load(GU + row * s_gu + inter + c, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(Y + row * s_y + c, (s.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty),
             mask=m)
