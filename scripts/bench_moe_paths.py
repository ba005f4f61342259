"""Where the MoE's per-pair path should hand over to the grouped path: the 23 MoE layers of the
quantized Lightning preset (random weights, so near-uniform routing) run one after another
on T distinct random tokens, timed inside a CUDA graph, once through each path.

The pair path (``MoE.routed_pairs``: each distinct expert read once for up to 16 tokens, the
shared expert riding in the same two launches) serves up to ``PAIR_PATH_MAX_PAIRS`` (token,
expert) pairs and, for packed experts, up to ``PAIR_DEDUP_MAX_TOKENS`` tokens (past them it
would read an expert once per pair, 2-3x slower when measured, so the layer does not take it
and the token counts stop at 16); the grouped path (sort by expert, gather, two grouped W4A16
GEMMs, the shared expert apart) serves the rest. A verify of b requests at width w has b * w
tokens, so the cut decides which widths of small batches cost what. Prints microseconds per
MoE stack and per layer for each T, the faster path, the largest pair count where the pair
path still wins, and the largest difference between the two paths' outputs of the last layer
(the same sums, rounded in another order).

    python scripts/bench_moe_paths.py [--tokens 1,2,...] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.bench import presets  # noqa: E402
from blockspec.bench.jsonl import emit_text  # noqa: E402
from blockspec.bench.timing import graph_time_ms  # noqa: E402
from blockspec.layers import moe as moe_mod  # noqa: E402

TOKENS = (1, 2, 4, 6, 8, 10, 11, 12, 14, 16)


def stack_us(layers: list, x: torch.Tensor, max_pairs: int) -> tuple[float, torch.Tensor]:
    """Microseconds of the MoE stack on ``x`` with the pair path capped at ``max_pairs``
    pairs, and the last layer's output."""
    saved, moe_mod.PAIR_PATH_MAX_PAIRS = moe_mod.PAIR_PATH_MAX_PAIRS, max_pairs
    try:
        def run() -> torch.Tensor:
            # every layer on the same tokens (its own experts, router and shared expert)
            return [layer(x) for layer in layers][-1]
        return 1000 * graph_time_ms(run, calls=3, reps=10), run()
    finally:
        moe_mod.PAIR_PATH_MAX_PAIRS = saved


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--out")
    a = p.parse_args()
    dev = torch.device("cuda")
    model = presets.build_target("nemotron-3.5-lightning", dev, torch.bfloat16, quantized=True)
    layers = [m for m in model.modules() if isinstance(m, moe_mod.MoE)]
    topk = model.cfg.num_experts_per_tok
    lines = [f"{len(layers)} MoE layers, top-{topk}; current PAIR_PATH_MAX_PAIRS "
             f"{moe_mod.PAIR_PATH_MAX_PAIRS}",
             "tokens pairs pair_us grouped_us pair_us/layer grouped_us/layer faster max_abs_diff"]
    best_cut = 0
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.inference_mode():
        for t in (int(v) for v in a.tokens.split(",")):
            x = torch.randn(t, model.cfg.hidden_size, device=dev, dtype=torch.bfloat16,
                            generator=g)
            pair_us, pair_out = stack_us(layers, x, 1 << 30)
            grouped_us, grouped_out = stack_us(layers, x, 0)
            diff = (pair_out.float() - grouped_out.float()).abs().max().item()
            faster = "pair" if pair_us <= grouped_us else "grouped"
            if faster == "pair":
                best_cut = max(best_cut, t * topk)
            n = len(layers)
            lines.append(f"{t} {t * topk} {pair_us:.1f} {grouped_us:.1f} {pair_us / n:.2f} "
                         f"{grouped_us / n:.2f} {faster} {diff:.3g}")
    lines.append(f"largest pair count where the pair path won: {best_cut}")
    emit_text(lines, a.out)


if __name__ == "__main__":
    main()
