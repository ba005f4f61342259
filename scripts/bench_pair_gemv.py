"""Tile sweep of the per-pair expert GEMV at Lightning's expert shapes, timed in CUDA graphs:
achieved GB/s per (pairs, projection, block_n, block_k, warps); * marks the default. Then the
deduplicating kernel against the plain one at a verify's 24 and 36 pairs (4 and 6 tokens x
top-6) under three routings: random over 128 experts, a pool of 12 (heavy sharing, as
consecutive tokens of a trained model share experts) and every token the same 6. GB/s there
counts each distinct expert once (the bytes dedup reads; the plain kernel reads more).

    python scripts/bench_pair_gemv.py [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.bench.jsonl import emit_text  # noqa: E402
from blockspec.bench.timing import graph_time_ms  # noqa: E402
from blockspec.kernels.moe_pairs import pair_gemv  # noqa: E402

EXPERTS, HIDDEN, INNER, TOPK = 128, 2688, 1856, 6
DEDUP_TILES = ((16, 128, 8), (16, 128, 4), (32, 128, 4), (16, 256, 4), (32, 64, 4))


def routing(tokens: int, kind: str, dev: torch.device) -> torch.Tensor:
    """ids [tokens, TOPK], each token's experts distinct."""
    pool = {"random": EXPERTS, "pool12": 12, "same": TOPK}[kind]
    experts = torch.randperm(EXPERTS, device=dev)[:pool]
    return torch.stack([experts[torch.randperm(pool, device=dev)[:TOPK]] for _ in range(tokens)])


def tile_sweep(wu: torch.Tensor, wd: torch.Tensor, dev: torch.device) -> list[str]:
    lines = ["pairs proj block_n block_k warps us GBps default"]
    for tokens in (1, 4):
        ids = routing(tokens, "random", dev)
        pairs = ids.numel()
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
        up = torch.randn(pairs, INNER, device=dev, dtype=torch.bfloat16)
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
    return lines


def dedup_table(wu: torch.Tensor, wd: torch.Tensor, dev: torch.device) -> list[str]:
    lines = ["", "pairs routing distinct proj plain_us dedup_us(block_n,block_k,warps) "
             "best_dedup_us speedup dedup_GBps"]
    for tokens in (4, 6):
        for kind in ("random", "pool12", "same"):
            ids = routing(tokens, kind, dev)
            pairs, distinct = ids.numel(), ids.unique().numel()
            x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
            up = torch.randn(pairs, INNER, device=dev, dtype=torch.bfloat16)
            for proj, w, inp, per_pair in (("up", wu, x, False), ("down", wd, up, True)):
                want = pair_gemv(inp, ids, w, x_per_pair=per_pair)
                got = pair_gemv(inp, ids, w, x_per_pair=per_pair, dedup=True)
                err = (got.float() - want.float()).abs().max().item()
                assert err <= 2e-2 * want.float().abs().max().item(), (proj, kind, err)
                plain = 1000 * graph_time_ms(
                    lambda: pair_gemv(inp, ids, w, x_per_pair=per_pair), calls=50, reps=5)
                times = []
                for bn, bk, warps in DEDUP_TILES:
                    call = lambda: pair_gemv(inp, ids, w, x_per_pair=per_pair,  # noqa: E731
                                             dedup=True, block_n=bn, block_k=bk,
                                             num_warps=warps)
                    times.append(1000 * graph_time_ms(call, calls=50, reps=5))
                best = min(times)
                cells = " ".join(f"{t:.1f}({bn},{bk},{wp})"
                                 for t, (bn, bk, wp) in zip(times, DEDUP_TILES))
                nbytes = distinct * w[0].numel() * 2
                lines.append(f"{pairs} {kind} {distinct} {proj} {plain:.1f} {cells} {best:.1f} "
                             f"{plain / best:.2f} {nbytes / best / 1e3:.0f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--dedup-only", action="store_true", help="skip the plain kernel's sweep")
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    wu = torch.randn(EXPERTS, INNER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    wd = torch.randn(EXPERTS, HIDDEN, INNER, device=dev, dtype=torch.bfloat16) * 0.02
    with torch.inference_mode():
        lines = [] if a.dedup_only else tile_sweep(wu, wd, dev)
        lines += dedup_table(wu, wd, dev)
    emit_text(lines, a.out)


if __name__ == "__main__":
    main()
