"""Triton kernel of the FP8 activation quantization (``kernels/fp8_quant.py`` has the launcher)."""
import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
RNE_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2^23: fp32 keeps no fraction bits next to it


@triton.jit
def e4m3_round(x, scale):
    """fp32 ``x`` / ``scale`` clamped to +-448 and rounded to nearest even on the E4M3 grid, as
    an fp32 value that an fp8 cast then holds exactly (also called by the fused norms).

    The value is rounded to the E4M3 grid in fp32 first, so the fp8 cast is exact and its own
    rounding never matters (the interpreter truncates fp32 -> fp8 casts; on sm89 Triton casts
    through fp16, which would round twice). With e the exponent of |v|, raised to -6 (E4M3's
    smallest normal exponent: subnormals keep the step 2^-9), the step is q = 2^(e-3) and
    t = |v| / q < 16 is rounded to an even-tied integer by (t + 1.5*2^23) - 1.5*2^23. Scaling by
    powers of two made from exponent bits is exact. The pair is not folded: LLVM and ptxas do
    not reassociate fp adds without fast-math flags, which Triton does not set (the sm90 SASS
    keeps FFMA + FADD); the FFMA that contracts t's product into the add rounds that exact
    product once, as the add alone would. The sign comes back from the bits, so -0 and tiny
    negatives stay -0 as in torch (the magic add would give +0)."""
    # IEEE division like torch's: a plain ``/`` compiles to the approximate div.full.f32
    v = tl.math.div_rn(x, scale)
    v = tl.clamp(v, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = tl.maximum((mag >> 23) - 127, -6)
    inv_q = ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)   # 2^(3-e)
    q = ((127 - 3 + e) << 23).to(tl.float32, bitcast=True)       # 2^(e-3)
    t = mag.to(tl.float32, bitcast=True) * inv_q
    n = (t + RNE_MAGIC) - RNE_MAGIC
    return ((n * q).to(tl.int32, bitcast=True) | (bits ^ mag)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_quant_kernel(X, SCALE, OUT, K, s_x, s_o, BLOCK_K: tl.constexpr):
    """Row m, columns [kb * BLOCK_K, ...): OUT = e4m3(clamp(X / SCALE, -448, 448)), rounded to
    nearest even, bit for bit as torch does it (``e4m3_round``)."""
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cm = c < K
    x = tl.load(X + m * s_x + c, mask=cm, other=0.0).to(tl.float32)
    r = e4m3_round(x, tl.load(SCALE).to(tl.float32))
    tl.store(OUT + m * s_o + c, r.to(OUT.dtype.element_ty), mask=cm)
