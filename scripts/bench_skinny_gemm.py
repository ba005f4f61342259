"""The skinny GEMM against cuBLAS (``F.linear``) at the dense decode shapes of Lightning and its
bench drafts, timed in CUDA graphs with the weights rotated through copies (> 2x the L2), as a
model reads a different weight every layer: us and achieved GB/s per (shape, rows, tile).

    python scripts/bench_skinny_gemm.py [--out FILE]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.bench.timing import graph_time_ms  # noqa: E402
from blockspec.kernels.skinny_gemm import skinny_gemm  # noqa: E402

SHAPES = {   # name: (N, K)
    "mamba_in": (10304, 2688), "mamba_out": (2688, 4096), "attn_qkv": (4608, 2688),
    "attn_o": (2688, 4096), "shared_up": (3712, 2688), "shared_down": (2688, 3712),
    "draft_qkv": (3072, 2688), "draft_o": (2688, 2048), "draft_gate_up": (10752, 2688),
    "draft_down": (2688, 5376), "router_fp32": (128, 2688),
}
TILES = [(8, 128, 4), (16, 128, 4), (16, 128, 8), (32, 128, 8), (16, 64, 8), (16, 256, 8)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--rows", default="1,4,8")
    a = p.parse_args()
    dev = torch.device("cuda")
    lines = ["shape rows impl block_n block_k warps us GBps"]
    best = {}
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            copies = max(2, -(-120 * 2 ** 20 // (n * k * 2)))
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for m in (int(r) for r in a.rows.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                nbytes = n * k * 2
                it = itertools.cycle(ws)
                fp32 = name == "router_fp32"
                if fp32:
                    t = graph_time_ms(lambda: F.linear(x.float(), next(it).float()), copies, 20)
                else:
                    t = graph_time_ms(lambda: F.linear(x, next(it)), copies, 20)
                lines.append(f"{name} {m} cublas - - - {t * 1e3:.1f} {nbytes / t / 1e6:.0f}")
                best[(name, m, "cublas")] = t
                for bn, bk, w in TILES:
                    it = itertools.cycle(ws)
                    out = torch.float32 if fp32 else None
                    try:
                        t = graph_time_ms(lambda: skinny_gemm(x, next(it), out_dtype=out, block_n=bn,
                                                              block_k=bk, num_warps=w), copies, 20)
                    except Exception as e:  # noqa: BLE001 - a failing tile is reported, not fatal
                        lines.append(f"{name} {m} skinny {bn} {bk} {w} failed {type(e).__name__}")
                        continue
                    lines.append(f"{name} {m} skinny {bn} {bk} {w} {t * 1e3:.1f} {nbytes / t / 1e6:.0f}")
                    if t < best.get((name, m, "skinny"), (1e9,))[0]:
                        best[(name, m, "skinny")] = (t, bn, bk, w)
            del ws
    lines.append("# best per (shape, rows): cuBLAS us, skinny us (tile), speed-up")
    for name in SHAPES:
        for m in (int(r) for r in a.rows.split(",")):
            c = best.get((name, m, "cublas"))
            s = best.get((name, m, "skinny"))
            if c and s:
                lines.append(f"# {name} rows {m}: cublas {c * 1e3:.1f} skinny {s[0] * 1e3:.1f} "
                             f"({s[1]}x{s[2]} w{s[3]}) x{c / s[0]:.2f}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
