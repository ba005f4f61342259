"""Triton kernel of relu(x)^2 (``kernels/relu2.py`` has the launcher)."""
import triton
import triton.language as tl


@triton.jit
def _relu2_kernel(X, Y, n, BLOCK: tl.constexpr):
    """y = relu(x)^2 in fp32, rounded once to Y's dtype (torch's square does the same)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.maximum(tl.load(X + i, mask=m, other=0.0).to(tl.float32), 0.0)
    tl.store(Y + i, (x * x).to(Y.dtype.element_ty), mask=m)
