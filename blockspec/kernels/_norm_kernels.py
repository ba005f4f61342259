"""Triton kernels of the fused norms (``kernels/norm.py`` has the launchers and references).
With FP8 the output is the normalised value, rounded to the input's dtype as without it, then
quantized to E4M3 at the next FP8 linear's static input scale: the activation quantization that
linear would launch, done in the norm's epilogue (``_fp8_quant_kernels.e4m3_round``)."""
from pathlib import Path

import triton
import triton.language as tl

from blockspec.kernels.triton_loader import load_kernels

_fp8 = load_kernels(Path(__file__).with_name("_fp8_quant_kernels.py"))


@triton.jit
def _rms_norm_kernel(X, R, W, Y, HOUT, SCALE, n, eps, s_x, s_r, s_y, s_h,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, FP8: tl.constexpr):
    """One row: h = x (+ r, rounded to x's dtype and stored), y = w * h * rsqrt(mean(h^2)+eps)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n
    x = tl.load(X + row * s_x + c, mask=m, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(R + row * s_r + c, mask=m, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(HOUT + row * s_h + c, x, mask=m)
    xf = x.to(tl.float32)
    ss = tl.reduce(xf * xf, 0, tl.standard._sum_combine)     # numpy in the interpreter
    rstd = 1.0 / tl.sqrt(ss / n + eps)
    w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    y = (w * (xf * rstd)).to(X.dtype.element_ty)
    if FP8:
        y = _fp8.e4m3_round(y.to(tl.float32), tl.load(SCALE).to(tl.float32))
    tl.store(Y + row * s_y + c, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _gated_rms_norm_kernel(V, Z, W, Y, SCALE, group, eps, s_v, s_z, s_y, BLOCK: tl.constexpr,
                           FP8: tl.constexpr):
    """One (row, group): v = y * silu(z), RMS-normalised over the group, times w."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    c = g * group + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < group
    v = tl.load(V + row * s_v + c, mask=m, other=0.0).to(tl.float32)
    z = tl.load(Z + row * s_z + c, mask=m, other=0.0).to(tl.float32)
    v = v * (z / (1.0 + tl.exp(-z)))
    ss = tl.reduce(v * v, 0, tl.standard._sum_combine)       # numpy in the interpreter
    rstd = 1.0 / tl.sqrt(ss / group + eps)
    w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    y = (w * (v * rstd)).to(Z.dtype.element_ty)
    if FP8:
        y = _fp8.e4m3_round(y.to(tl.float32), tl.load(SCALE).to(tl.float32))
    tl.store(Y + row * s_y + c, y.to(Y.dtype.element_ty), mask=m)
