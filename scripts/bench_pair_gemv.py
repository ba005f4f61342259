"""Tile sweep of the per-pair expert GEMV at Lightning's expert shapes, timed in CUDA graphs:
achieved GB/s per (pairs, projection, block_n, block_k, warps); * marks the default.

    python scripts/bench_pair_gemv.py [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.bench.timing import graph_time_ms  # noqa: E402
from blockspec.kernels.moe_pairs import pair_gemv  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    a = p.parse_args()
    dev = torch.device("cuda")
    experts, hidden, inner = 128, 2688, 1856
    wu = torch.randn(experts, inner, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    wd = torch.randn(experts, hidden, inner, device=dev, dtype=torch.bfloat16) * 0.02
    lines = ["pairs proj block_n block_k warps us GBps default"]
    with torch.inference_mode():
        for tokens in (1, 4):
            ids = torch.stack([torch.randperm(experts, device=dev)[:6] for _ in range(tokens)])
            pairs = ids.numel()
            x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
            up = torch.randn(pairs, inner, device=dev, dtype=torch.bfloat16)
            for proj, w, inp, per_pair in (("up", wu, x, False), ("down", wd, up, True)):
                nbytes = pairs * w[0].numel() * 2
                for bn in (16, 32, 64):
                    for bk, warps in ((128, 4), (256, 4), (128, 8)):
                        call = lambda: pair_gemv(inp, ids, w, x_per_pair=per_pair,  # noqa: E731
                                                 block_n=bn, block_k=bk, num_warps=warps)
                        us = 1000 * graph_time_ms(call, calls=50, reps=5)
                        mark = "*" if (bn, bk, warps) == (16, 128, 8) else ""
                        lines.append(f"{pairs} {proj} {bn} {bk} {warps} {us:.1f} "
                                     f"{nbytes / us / 1e3:.0f} {mark}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
