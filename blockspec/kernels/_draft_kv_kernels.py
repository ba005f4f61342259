"""Triton kernels of the draft's fused K/V writes: the context write and a draft block's q/k/v
(``kernels/draft_kv.py`` has the launchers and the torch references)."""
from pathlib import Path

import triton
import triton.language as tl

from blockspec.kernels.triton_loader import load_kernels

# the rotary kernel's cos/sin (full range reduction, like the torch reference), in this mode
_cos_sin = load_kernels(Path(__file__).with_name("_rotary_kernels.py"))._cos_sin


@triton.jit
def _norm_rope(X, NW, pos, F, heads, half, eps, DT: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """``heads`` heads of ``2 * half`` values at X, each RMS-normalised with the weight at NW
    (fp32, rounded to DT, as ``RMSNorm.reference``) and NeoX-rotated at ``pos`` with the
    frequencies at F (fp32, rounded to DT, as ``apply_rotary_reference``). Returns the two
    rotated halves (DT), their offsets from a head-major [heads, 2 * half] base, the mask."""
    d = 2 * half
    i = tl.arange(0, BLOCK_D)
    mi = i < half
    h = tl.arange(0, BLOCK_H)
    m = (h < heads)[:, None] & mi[None, :]
    off = h[:, None].to(tl.int64) * d + i[None, :]
    x1 = tl.load(X + off, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X + off + half, mask=m, other=0.0).to(tl.float32)
    # tl.standard's sum combine: numpy in the interpreter (see triton_loader)
    ss = (tl.reduce(x1 * x1, 1, tl.standard._sum_combine)
          + tl.reduce(x2 * x2, 1, tl.standard._sum_combine))
    rstd = (1.0 / tl.sqrt(ss / d + eps))[:, None]
    w1 = tl.load(NW + i, mask=mi, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(NW + half + i, mask=mi, other=0.0).to(tl.float32)[None, :]
    # the reference rounds the normalised values to the output dtype before rotating them
    n1 = (w1 * (x1 * rstd)).to(DT).to(tl.float32)
    n2 = (w2 * (x2 * rstd)).to(DT).to(tl.float32)
    c, s = _cos_sin(pos * tl.load(F + i, mask=mi, other=0.0))
    c = c[None, :]
    s = s[None, :]
    return (n1 * c - n2 * s).to(DT), (n2 * c + n1 * s).to(DT), off, m


@triton.jit
def _draft_kv_kernel(KV, P, S, NW, F, KO, VO, s_kv, s_pl, s_ps, heads, half, eps,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (row, draft layer): the layer's K heads RMS-normalised with its k_norm weight and
    NeoX-rotated at the row's position (``_norm_rope``), stored with the V heads at the row's
    slot of that layer's pool. KV rows hold, per layer, K then V (``heads * 2 * half`` values
    each)."""
    row = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    d = 2 * half
    base = row * s_kv + layer * (2 * heads * d)
    pos = tl.load(P + row).to(tl.float32)
    dt: tl.constexpr = KO.dtype.element_ty
    y1, y2, off, m = _norm_rope(KV + base, NW + layer * d, pos, F + layer * half, heads, half,
                                eps, dt, BLOCK_H, BLOCK_D)
    slot = tl.load(S + row).to(tl.int64)
    dst = layer * s_pl + slot * s_ps + off
    tl.store(KO + dst, y1, mask=m)
    tl.store(KO + dst + half, y2, mask=m)
    v1 = tl.load(KV + base + heads * d + off, mask=m, other=0.0)
    v2 = tl.load(KV + base + heads * d + off + half, mask=m, other=0.0)
    tl.store(VO + dst, v1.to(dt), mask=m)
    tl.store(VO + dst + half, v2.to(dt), mask=m)


@triton.jit
def _draft_block_qkv_kernel(QKV, P, S, QW, KW, F, QO, KO, VO, s_qkv, s_qo, layer_off, s_ps,
                            q_heads, kv_heads, half, q_eps, k_eps, BLOCK_HQ: tl.constexpr,
                            BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row of a draft block after the fused q/k/v projection (QKV rows: Q heads, K heads,
    V heads): program (row, 0) writes q_norm + rotary of the Q heads to QO; program (row, 1)
    writes k_norm + rotary of the K heads and the V heads at the row's slot of the layer's
    pools (``layer_off`` elements in). That is what a draft layer's two norms, two rotaries
    and the attention backend's two cache writes do in six launches. (The branches use their
    own names: Triton rejects a name bound to tiles of two shapes in a runtime ``if``.)"""
    row = tl.program_id(0).to(tl.int64)
    d = 2 * half
    pos = tl.load(P + row).to(tl.float32)
    src = QKV + row * s_qkv
    if tl.program_id(1) == 0:
        dq: tl.constexpr = QO.dtype.element_ty
        q1, q2, q_off, q_m = _norm_rope(src, QW, pos, F, q_heads, half, q_eps, dq, BLOCK_HQ,
                                        BLOCK_D)
        tl.store(QO + row * s_qo + q_off, q1, mask=q_m)
        tl.store(QO + row * s_qo + q_off + half, q2, mask=q_m)
    else:
        dk: tl.constexpr = KO.dtype.element_ty
        k_src = src + q_heads * d
        k1, k2, k_off, k_m = _norm_rope(k_src, KW, pos, F, kv_heads, half, k_eps, dk,
                                        BLOCK_HKV, BLOCK_D)
        dst = tl.load(S + row).to(tl.int64) * s_ps + layer_off + k_off
        tl.store(KO + dst, k1, mask=k_m)
        tl.store(KO + dst + half, k2, mask=k_m)
        v1 = tl.load(k_src + kv_heads * d + k_off, mask=k_m, other=0.0)
        v2 = tl.load(k_src + kv_heads * d + k_off + half, mask=k_m, other=0.0)
        tl.store(VO + dst, v1.to(dk), mask=k_m)
        tl.store(VO + dst + half, v2.to(dk), mask=k_m)
