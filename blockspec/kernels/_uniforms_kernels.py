"""Triton kernel of the counter-based uniforms (``kernels/uniforms.py`` has the launcher; the
reference is ``sampling.uniforms_reference``). Integer arithmetic in int64 with the same
16-bit-half products and masks as the reference, so both give the same bits."""
import triton
import triton.language as tl


@triton.jit
def _mul32(x, lo: tl.constexpr, hi: tl.constexpr):
    """(x * (hi << 16 | lo)) mod 2**32 for x in [0, 2**32), no int64 overflow."""
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x352D, 0x7FEB)
    x = x ^ (x >> 15)
    x = _mul32(x, 0xA68B, 0x846C)
    return x ^ (x >> 16)


@triton.jit
def _uniforms_kernel(SEEDS, COUNTERS, OUT, width, STREAM: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: row i's ``width`` uniforms (fp64, 53 random bits each)."""
    i = tl.program_id(0)
    seed = tl.load(SEEDS + i).to(tl.int64)
    ctr = tl.load(COUNTERS + i).to(tl.int64)
    lo = seed & 0xFFFFFFFF
    hi = (seed >> 32) & 0xFFFFFFFF
    h = _hash32(_hash32(lo ^ 0x6A09E667) ^ hi ^ 0xBB67AE85)
    h = _hash32(h ^ (ctr & 0xFFFFFFFF) ^ 0x3C6EF372)
    j = tl.arange(0, BLOCK)
    col = j.to(tl.int64) + (STREAM << 16)
    h = _hash32(h ^ _hash32(col ^ 0xA54FF53A))
    h2 = _hash32(h ^ 0x9E3779B9)
    bits = (h >> 5) * 67108864 + (h2 >> 6)
    u = bits.to(tl.float64) * 1.1102230246251565e-16
    tl.store(OUT + i.to(tl.int64) * width + j, u, mask=j < width)
