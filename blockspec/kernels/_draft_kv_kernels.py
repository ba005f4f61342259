"""Triton kernel of the draft's fused context K/V write (``kernels/draft_kv.py`` has the
launcher; the torch reference is ``DFlashDraftModel.write_context``)."""
from pathlib import Path

import triton
import triton.language as tl

from blockspec.kernels.triton_loader import load_kernels

# the rotary kernel's cos/sin (full range reduction, like the torch reference), in this mode
_cos_sin = load_kernels(Path(__file__).with_name("_rotary_kernels.py"))._cos_sin


@triton.jit
def _add_fn(a, b):
    return a + b


@triton.jit
def _draft_kv_kernel(KV, P, S, NW, F, KO, VO, s_kv, s_pl, s_ps, heads, half, eps,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (row, draft layer): the layer's K heads RMS-normalised with its k_norm weight (fp32,
    rounded to the pool dtype), NeoX-rotated at the row's position (fp32, rounded), and stored
    with the V heads at the row's slot of that layer's pool. KV rows hold, per layer, K then V
    (``heads * 2 * half`` values each)."""
    row = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    d = 2 * half
    i = tl.arange(0, BLOCK_D)
    mi = i < half
    h = tl.arange(0, BLOCK_H)
    m = (h < heads)[:, None] & mi[None, :]
    base = row * s_kv + layer * (2 * heads * d)
    off = h[:, None].to(tl.int64) * d + i[None, :]
    k1 = tl.load(KV + base + off, mask=m, other=0.0).to(tl.float32)
    k2 = tl.load(KV + base + off + half, mask=m, other=0.0).to(tl.float32)
    ss = tl.reduce(k1 * k1, 1, _add_fn) + tl.reduce(k2 * k2, 1, _add_fn)
    rstd = (1.0 / tl.sqrt(ss / d + eps))[:, None]
    w1 = tl.load(NW + layer * d + i, mask=mi, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(NW + layer * d + half + i, mask=mi, other=0.0).to(tl.float32)[None, :]
    dt = KO.dtype.element_ty
    # the reference rounds the normalised K to the pool dtype before rotating it
    x1 = (w1 * (k1 * rstd)).to(dt).to(tl.float32)
    x2 = (w2 * (k2 * rstd)).to(dt).to(tl.float32)
    angle = tl.load(P + row).to(tl.float32) * tl.load(F + layer * half + i, mask=mi, other=0.0)
    c, s = _cos_sin(angle)
    c = c[None, :]
    s = s[None, :]
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    slot = tl.load(S + row).to(tl.int64)
    dst = layer * s_pl + slot * s_ps + off
    tl.store(KO + dst, y1.to(dt), mask=m)
    tl.store(KO + dst + half, y2.to(dt), mask=m)
    v1 = tl.load(KV + base + heads * d + off, mask=m, other=0.0)
    v2 = tl.load(KV + base + heads * d + off + half, mask=m, other=0.0)
    tl.store(VO + dst, v1.to(dt), mask=m)
    tl.store(VO + dst + half, v2.to(dt), mask=m)
