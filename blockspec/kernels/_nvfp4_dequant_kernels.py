"""Triton kernel that dequantizes packed NVFP4 weights (the W4A16 kernel's layout) to 16-bit
(``kernels/nvfp4_dequant.py`` has the launcher and the reference).

Each program decodes a [BLOCK_N, 4 * BLOCK_W] tile of one expert: BLOCK_W uint16 words per
row, word i holding K = 4i + r in "stream" r, whose (m, e0, e1, s) bits sit at the positions
``w4a16_layout.STREAM_BITS`` lists. Values are built from their bits in fp32 without
subnormals (FTZ-proof), signs as bits (a "-0" scale stays -0): an E2M1 magnitude (e, m) is 0.5 m for e = 0, else 2^(e-1) (1 + m/2);
an E4M3 scale (e, m) is m 2^-9 for e = 0, else 2^(e-7) (1 + m/8). The arithmetic is the
reference's: one fp32 product of scale and global scale per block, one fp32 product per
weight, one rounding to the output dtype, so the result is bit-identical.
"""
import triton
import triton.language as tl


@triton.jit
def _dq_bit(w, pos: tl.constexpr):
    return (w >> pos) & 1


@triton.jit
def _dq_stream(w, scale, M: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr,
               S: tl.constexpr):
    """Stream value times its block scale, in fp32 (code 8, "-0", is +0 as in ModelOpt)."""
    m = _dq_bit(w, M)
    e = _dq_bit(w, E0) | (_dq_bit(w, E1) << 1)
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    val = tl.where(_dq_bit(w, S) == 1, 0.0 - mag, mag)
    return val * scale


@triton.jit
def _nvfp4_dequant_kernel(w_ptr, s_ptr, s2_ptr, out_ptr, N, WORDS,
                          stride_we, stride_wn, stride_se, stride_sn, stride_oe, stride_on,
                          BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_w = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    words = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (rows < N)[:, None] & (words < WORDS)[None, :]
    w_base = (w_ptr + e * stride_we).to(tl.pointer_type(tl.uint16))
    w = tl.load(w_base + rows[:, None] * (stride_wn // 2) + words[None, :], mask=mask, other=0)
    w = w.to(tl.int32) & 0xFFFF
    sb = tl.load(s_ptr + e * stride_se + rows[:, None] * stride_sn + (words // 4)[None, :],
                 mask=mask, other=0).to(tl.int32) & 0xFF
    se = (sb >> 3) & 0xF
    sm = sb & 7
    s_norm = (((se + 120) << 23) | (sm << 20)).to(tl.float32, bitcast=True)
    s_mag = tl.where(se == 0, sm.to(tl.float32) * 0.001953125, s_norm)
    s_mag = tl.where((se == 15) & (sm == 7), float("nan"), s_mag)
    s_val = (s_mag.to(tl.int32, bitcast=True) | ((sb >> 7) << 31)).to(tl.float32, bitcast=True)
    scale = s_val * tl.load(s2_ptr + e)
    # (m, e0, e1, s) bit positions per stream: w4a16_layout.STREAM_BITS
    v0 = _dq_stream(w, scale, 4, 5, 6, 13)
    v1 = _dq_stream(w, scale, 0, 1, 2, 9)
    v2 = _dq_stream(w, scale, 10, 11, 12, 3)
    v3 = _dq_stream(w, scale, 14, 7, 8, 15)
    vals = tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BLOCK_N, 4 * BLOCK_W))
    cols = pid_w * (4 * BLOCK_W) + tl.arange(0, 4 * BLOCK_W)
    omask = (rows < N)[:, None] & (cols < 4 * WORDS)[None, :]
    o = out_ptr + e * stride_oe + rows[:, None] * stride_on + cols[None, :]
    tl.store(o, vals.to(out_ptr.dtype.element_ty), mask=omask)
