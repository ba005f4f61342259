"""A numpy emulation of ``_w4a16_pairs.cu``'s lane-level plan (leaders, fragment loads, the
decode, the prmt pairing of x, mma.m16n8k16 operand positions, the K-split sum and the epilogue)
against ``pair_w4a16_reference``, on CPU. It checks the plan, not the CUDA code: the GPU tests
do that. Swapping two prmt selectors takes the error from ~0.5 % (bf16 rounding) to ~90 %.

    python scripts/emulate_w4a16_pairs.py
"""
import numpy as np
import torch
from blockspec.kernels import w4a16 as tw
from blockspec.quant.nvfp4 import quantize_nvfp4
from blockspec.kernels.w4a16_layout import to_kernel_layout

def bf16_bits_to_f32(b):  # uint16 array -> float32
    return (b.astype(np.uint32) << 16).view(np.float32)

def f32_to_bf16_bits(f):  # round to nearest even
    u = f.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return r.astype(np.uint16)

def byte_perm(x, y, s):
    b = [(x >> (8*i)) & 0xFF for i in range(4)] + [(y >> (8*i)) & 0xFF for i in range(4)]
    return sum(int(b[(s >> (4*i)) & 0x7]) << (8*i) for i in range(4))

def bmul(a, s):  # bf16x2 multiply (exact here), returns pair of floats
    lo = bf16_bits_to_f32(np.array([a & 0xFFFF], np.uint16))[0] * bf16_bits_to_f32(np.array([s & 0xFFFF], np.uint16))[0]
    hi = bf16_bits_to_f32(np.array([a >> 16], np.uint16))[0] * bf16_bits_to_f32(np.array([s >> 16], np.uint16))[0]
    return (float(lo), float(hi))

def decode8(w, s):
    sw = byte_perm(w, 0, 0x2301)
    return [bmul(((w << 2) & 0x81C081C0) & 0xFFFFFFFF, s), bmul(((w << 6) & 0x81C081C0) & 0xFFFFFFFF, s),
            bmul(((sw << 4) & 0x81C081C0) & 0xFFFFFFFF, s), bmul((w & 0x81808180) | (sw & 0x00400040), s)]

def scale2(b):
    h = np.array([(b & 0x7F) << 7], np.uint16).view(np.float16)[0]
    f = np.float32(h) * np.float32(2.0 ** 126)
    bb = int(f32_to_bf16_bits(np.array([f]))[0])
    return bb | (bb << 16)

def kernel(x, ids, w, ws, ws2, M, topk, N, K, shared_parts, x_per_pair, relu2, distinct, MT=2, KW=4, NT=1):
    E = w.shape[0]; npairs = M * topk; shared_base = E - shared_parts
    rows = npairs + M * shared_parts
    out = np.full((rows, N), np.nan, np.float32)
    flat = ids.reshape(-1)
    for b in range(npairs + shared_parts):
        first = [None] * 16
        if b < npairs:
            e = flat[b]
            occ_b = sum(flat[j] == e for j in range((b // topk) * topk, b)) if not distinct else 0
            for j in range(npairs):
                if flat[j] != e: continue
                occ = sum(flat[jj] == e for jj in range((j // topk) * topk, j)) if not distinct else 0
                if occ == occ_b and (first[j // topk] is None or j < first[j // topk]): first[j // topk] = j
            lead = min(v for v in first[:M] if v is not None)
            if lead != b: continue
            orow = [first[t] if t < M else None for t in range(16)]
        else:
            e = shared_base + b - npairs
            orow = [npairs + t * shared_parts + (b - npairs) if t < M else None for t in range(16)]
        xrow = [None if o is None else (o if x_per_pair else t) for t, o in enumerate(orow)]
        wb = w[e].reshape(-1); sb = ws[e].reshape(-1)
        for by in range(-(-N // (16 * MT))):
            n0 = by * 16 * MT
            red = np.zeros((KW, MT * 16, NT * 8), np.float64)
            for warp in range(KW):
                acc = np.zeros((MT, NT, 16, 8))  # full tile per (i,j) assembled from lanes
                for u in range(warp, K // 64, KW):
                    # per lane fragments
                    A = np.zeros((MT, 16, 16)); B = np.zeros((NT, 4, 16, 8))  # B per q
                    Aq = np.zeros((MT, 4, 16, 16))
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for i in range(MT):
                            dec = []
                            for h in range(2):
                                r = n0 + 16 * i + 8 * h + g
                                if r >= N: dec.append([(0.0, 0.0)] * 8); continue
                                off = r * (K // 2) + 32 * u + 8 * t
                                by8 = wb[off:off + 8].astype(np.uint32)
                                w0 = int(by8[0] | by8[1] << 8 | by8[2] << 16 | by8[3] << 24)
                                w1 = int(by8[4] | by8[5] << 8 | by8[6] << 16 | by8[7] << 24)
                                s = scale2(int(sb[r * (K // 16) + 4 * u + t]))
                                dec.append(decode8(w0, s) + decode8(w1, s))
                            for q in range(4):
                                # a0: row g, k 2t,2t+1 ; a1: row g+8 ; a2: row g, k 2t+8,+9 ; a3 row g+8
                                (Aq[i, q, g, 2*t], Aq[i, q, g, 2*t+1]) = dec[0][2*q]
                                (Aq[i, q, g+8, 2*t], Aq[i, q, g+8, 2*t+1]) = dec[1][2*q]
                                (Aq[i, q, g, 2*t+8], Aq[i, q, g, 2*t+9]) = dec[0][2*q+1]
                                (Aq[i, q, g+8, 2*t+8], Aq[i, q, g+8, 2*t+9]) = dec[1][2*q+1]
                        for j in range(NT):
                            xr = xrow[8 * j + g]; xr = 0 if xr is None else xr
                            seg = x[xr, 64 * u + 16 * t: 64 * u + 16 * t + 16]  # uint16 bits
                            X = [int(seg[2*c]) | int(seg[2*c+1]) << 16 for c in range(8)]
                            xb = []
                            for hf in range(2):
                                xb += [byte_perm(X[4*hf], X[4*hf+2], 0x5410), byte_perm(X[4*hf], X[4*hf+2], 0x7632),
                                       byte_perm(X[4*hf+1], X[4*hf+3], 0x5410), byte_perm(X[4*hf+1], X[4*hf+3], 0x7632)]
                            f = lambda v: bf16_bits_to_f32(np.array([v & 0xFFFF, v >> 16], np.uint16))
                            for q in range(4):
                                B[j, q, 2*t:2*t+2, g] = f(xb[2*q]); B[j, q, 2*t+8:2*t+10, g] = f(xb[2*q+1])
                    for i in range(MT):
                        for j in range(NT):
                            for q in range(4):
                                acc[i, j] += Aq[i, q] @ B[j, q]
                for i in range(MT):
                    for j in range(NT):
                        red[warp, 16*i:16*i+16, 8*j:8*j+8] = acc[i, j]
            gs = ws2[e] * 256.0
            for row in range(MT * 16):
                for tok in range(NT * 8):
                    o = orow[tok]; n = n0 + row
                    if o is None or n >= N: continue
                    v = np.float32(red[:, row, tok].sum() * gs)
                    y = bf16_bits_to_f32(f32_to_bf16_bits(np.array([v])))[0]
                    if relu2: y = max(y, 0.0); y = bf16_bits_to_f32(f32_to_bf16_bits(np.array([y * y], np.float32)))[0]
                    out[o, n] = y
    return out

torch.manual_seed(0)
E, N, K, topk, shared, M = 6, 40, 192, 3, 2, 3
g = torch.Generator().manual_seed(1)
packed = [quantize_nvfp4((torch.randn(N, K, generator=g) * 0.05).bfloat16()) for _ in range(E)]
w, s, s2 = (torch.stack([p[j] for p in packed]) for j in range(3))
w = to_kernel_layout(w)
ids = torch.tensor([[0, 1, 2], [1, 3, 0], [2, 2, 1]])  # token 2 names expert 2 twice
for x_per_pair, relu2, distinct, ids_ in [(False, True, True, ids[:2]), (True, False, False, ids)]:
    Mx = ids_.shape[0]
    rows = Mx * (topk + shared)
    x = torch.randn(rows if x_per_pair else Mx, K).bfloat16()
    out = kernel(x.view(torch.int16).numpy().view(np.uint16), ids_.numpy(), w.numpy(), s.view(torch.uint8).numpy(),
                 s2.reshape(-1).float().numpy(), Mx, topk, N, K, shared, x_per_pair, relu2, distinct)
    ref = tw.pair_w4a16_reference(x, ids_, w, s, s2, x_per_pair=x_per_pair, relu2=relu2, shared_parts=shared).float().numpy()
    print(x_per_pair, relu2, "nan", np.isnan(out).sum(), "rel", np.linalg.norm(out - ref) / np.linalg.norm(ref))
