"""The fused MoE routing kernels (kernels/moe_routing.py) against their torch references on the
GPU: an exactness sweep over many rows, then microseconds per MoE layer timed inside CUDA graphs
(where launch gaps, not work, dominate at small batches), and the sort's chunk size, to tune
``SORT_MAX_PAIRS`` and ``_SORT_CHUNK``.

    python scripts/bench_moe_routing.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.bench.timing import graph_time_ms  # noqa: E402
from blockspec.kernels import moe_routing as mr  # noqa: E402
from blockspec.layers.moe import route_reference, sort_by_expert_reference  # noqa: E402


def graph_us(fn) -> float:
    """Microseconds of one ``fn()`` inside a CUDA graph (``bench/timing.graph_time_ms``)."""
    return 1000 * graph_time_ms(fn, calls=20, reps=20)


def exactness(dev: torch.device) -> None:
    for experts, k, n_group, topk_group in [(128, 6, 1, 1), (256, 8, 8, 4), (512, 16, 1, 1),
                                            (96, 4, 3, 2)]:
        logits = 2 * torch.randn(8192, experts, device=dev)
        bias = 0.5 * torch.randn(experts, device=dev)
        ids, w = mr.route(logits, bias, k, n_group, topk_group, True, 2.5)
        want_ids, want_w = route_reference(logits, bias, k, n_group, topk_group, True, 2.5)
        rel = ((w - want_w).abs() / want_w.abs()).max().item()
        pairs = torch.randint(0, experts, (mr.SORT_MAX_PAIRS // k, k), device=dev)
        same = [torch.equal(a, b) for a, b in zip(mr.sort_by_expert(pairs, experts),
                                                  sort_by_expert_reference(pairs, experts))]
        print(f"E={experts} k={k} groups {n_group}/{topk_group}: rows with other ids "
              f"{(ids != want_ids).any(-1).sum().item()}/8192, max rel weight error {rel:.1e}; "
              f"sort of {pairs.numel()} pairs equal (order, offsets): {same}")


def timings(dev: torch.device, experts: int = 128, k: int = 6) -> None:
    bias = 0.5 * torch.randn(experts, device=dev)
    print(f"E={experts} k={k}, us per MoE layer in a graph: route (ref / fused), "
          "sort (ref / fused)")
    for tokens in [1, 4, 16, 64, 128, 256, 682, 1024]:
        logits = 2 * torch.randn(tokens, experts, device=dev)
        args = (bias, k, 1, 1, True, 2.5)
        ids = route_reference(logits, *args)[0]
        route = (graph_us(lambda: route_reference(logits, *args)),
                 graph_us(lambda: mr.route(logits, *args)))
        fused = (graph_us(lambda: mr.sort_by_expert(ids, experts))
                 if ids.numel() <= mr.SORT_MAX_PAIRS else float("nan"))
        sort = (graph_us(lambda: sort_by_expert_reference(ids, experts)), fused)
        print(f"  T={tokens:5d} pairs={ids.numel():5d}: route {route[0]:6.2f} / {route[1]:6.2f}, "
              f"sort {sort[0]:6.2f} / {sort[1]:6.2f}")
    print("sort, us by chunk size")
    for pairs in [6, 96, 384, 1536, 4092]:
        ids = torch.randint(0, experts, (pairs,), device=dev)
        row = [f"chunk {c}: {graph_us(lambda: mr.sort_by_expert(ids, experts, chunk=c)):6.2f}"
               for c in (16, 32, 64, 128)]
        print(f"  pairs={pairs:5d}: " + ", ".join(row) +
              f", reference {graph_us(lambda: sort_by_expert_reference(ids, experts)):6.2f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    device = torch.device("cuda")
    with torch.no_grad():
        exactness(device)
        timings(device)
