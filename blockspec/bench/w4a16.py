"""Achieved bandwidth of the Triton W4A16 NVFP4 GEMM on Lightning shapes, next to bf16 torch.

    python -m blockspec.bench.w4a16 --out w4a16.json [--quick | --sweep]

Per shape (N x K) and M in {1, 4, 8, 16, 64}: median time of the W4A16 kernel (default config
and the best of a few alternative configs, or of a full grid with ``--sweep``) and of ``x @ W_bf16^T``, each as GB/s of the bytes it
must move (packed weight + E4M3 scales, or bf16 weight; plus x and y), and as a fraction of the
device's measured copy bandwidth.  Calls are captured in a CUDA graph and replayed, so launch
overhead does not hide the kernel.  Every timed config is first checked against the reference.
Also times the grouped MoE kernel (128 experts, top-6) on the expert shapes.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Callable

import torch

SHAPES = {  # name: (N, K)
    "expert_up": (1856, 2688),
    "expert_down": (2688, 1856),
    "shared_expert_up": (3712, 2688),
    "lm_head": (131072, 2688),
}
MS = (1, 4, 8, 16, 64)
# Tried by default (cheap); ``--sweep`` tries the full grid below instead.
CANDIDATES = (
    {"block_n": 32}, {"block_n": 128}, {"block_k": 256}, {"num_warps": 8},
    {"block_n": 128, "num_warps": 8}, {"num_stages": 4},
)
SWEEP = {"block_n": (32, 64, 128), "block_k": (128, 256), "split_k": (None, 1, 2, 4),
         "num_warps": (4, 8), "num_stages": (3, 4)}


def _graph_time_ms(fn: Callable[[], object], calls: int, reps: int) -> float:
    """Median ms per call: ``calls`` calls captured in one CUDA graph, replayed ``reps`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: (read + write) bytes / time."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _graph_time_ms(lambda: b.copy_(a), calls=5, reps=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _configs(sweep: bool) -> list[dict]:
    if not sweep:
        return [dict(c) for c in CANDIDATES]
    keys = list(SWEEP)
    return [dict(zip(keys, values)) for values in itertools.product(*(SWEEP[k] for k in keys))]


def bench_dense(n: int, k: int, m: int, copy_gbs: float, sweep: bool, calls: int, reps: int,
                candidates: bool = True) -> dict:
    from blockspec.quant import triton_w4a16 as tw
    from blockspec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    g = torch.Generator(device="cuda").manual_seed(n * 131 + k + m)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    packed, scale, scale2 = quantize_nvfp4(w)
    w_bf16 = dequantize_nvfp4(packed, scale, scale2, torch.bfloat16)
    del w
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    ref = tw.w4a16_linear_reference(x, packed, scale, scale2)
    io = m * k * 2 + m * n * 2
    q_bytes = packed.numel() + scale.numel() + io
    bf16_bytes = w_bf16.numel() * 2 + io

    def run(cfg: dict) -> float | None:
        try:
            y = tw.w4a16_linear(x, packed, scale, scale2, **cfg)
            if _rel(y, ref) > 1e-2:
                return None
            return _graph_time_ms(lambda: tw.w4a16_linear(x, packed, scale, scale2, **cfg),
                                  calls, reps)
        except Exception:  # a config the compiler rejects (e.g. out of shared memory)
            return None

    default_ms = run({})
    best_ms, best_cfg = default_ms, {}
    for cfg in (_configs(sweep) if candidates or sweep else []):
        ms = run(cfg)
        if ms is not None and (best_ms is None or ms < best_ms):
            best_ms, best_cfg = ms, cfg
    torch_ms = _graph_time_ms(lambda: x @ w_bf16.T, calls, reps)

    def gbs(nbytes: int, ms: float | None) -> float | None:
        return None if ms is None else nbytes / (ms * 1e-3) / 1e9

    rec = {
        "N": n, "K": k, "M": m,
        "w4a16_default_ms": default_ms, "w4a16_default_gbs": gbs(q_bytes, default_ms),
        "w4a16_best_ms": best_ms, "w4a16_best_gbs": gbs(q_bytes, best_ms),
        "w4a16_best_config": best_cfg,
        "torch_bf16_ms": torch_ms, "torch_bf16_gbs": gbs(bf16_bytes, torch_ms),
        "w4a16_bytes": q_bytes, "bf16_bytes": bf16_bytes,
    }
    if best_ms is not None:
        rec["w4a16_best_frac_of_copy"] = rec["w4a16_best_gbs"] / copy_gbs
        rec["speedup_vs_bf16"] = torch_ms / best_ms
    return rec


def bench_grouped(n: int, k: int, tokens: int, calls: int, reps: int, experts: int = 128,
                  top_k: int = 6) -> dict:
    from blockspec.quant import triton_w4a16 as tw
    from blockspec.quant.nvfp4 import quantize_nvfp4

    g = torch.Generator(device="cuda").manual_seed(tokens + n)
    packed, scales, scales2 = [], [], []
    for _ in range(experts):
        p, s, s2 = quantize_nvfp4((torch.randn(n, k, device="cuda", generator=g) * 0.02)
                                  .bfloat16())
        packed.append(p), scales.append(s), scales2.append(s2)
    w, s, s2 = torch.stack(packed), torch.stack(scales), torch.stack(scales2)
    topk = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:top_k]
                        for _ in range(tokens)])
    order, offsets = tw.sort_by_expert(topk, experts)
    x = torch.randn(tokens, k, device="cuda", generator=g).bfloat16()[order // top_k]
    ref = tw.grouped_w4a16_reference(x, offsets, w, s, s2)
    blocks = tw.grouped_blocks(offsets, x.shape[0])
    y = tw.grouped_w4a16(x, offsets, w, s, s2, blocks=blocks)
    err = _rel(y, ref)
    ms = _graph_time_ms(lambda: tw.grouped_w4a16(x, offsets, w, s, s2, blocks=blocks),
                        calls, reps)
    active = int((offsets[1:] > offsets[:-1]).sum())
    nbytes = active * (n * k // 2 + n * k // 16) + x.numel() * 2 + x.shape[0] * n * 2
    return {"N": n, "K": k, "tokens": tokens, "experts": experts, "top_k": top_k,
            "active_experts": active, "rel_err": err, "ms": ms,
            "gbs": nbytes / (ms * 1e-3) / 1e9}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--quick", action="store_true", help="default config only, fewer repeats")
    ap.add_argument("--sweep", action="store_true", help="full config grid (slow: compiles)")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    calls, reps = (10, 5) if args.quick else (20, 15)
    copy_gbs = copy_bandwidth_gbs()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: device copy bandwidth {copy_gbs:.0f} GB/s")
    dense = []
    for name in args.shapes:
        n, k = SHAPES[name]
        for m in MS:
            rec = bench_dense(n, k, m, copy_gbs, sweep=args.sweep, calls=calls, reps=reps,
                              candidates=not args.quick)
            rec["shape"] = name
            dense.append(rec)
            best = rec["w4a16_best_gbs"]
            print(f"{name:17s} N={n:6d} K={k} M={m:3d}  w4a16 "
                  f"{(best or 0):7.0f} GB/s ({rec.get('w4a16_best_frac_of_copy', 0):.0%} of copy)"
                  f" {rec['w4a16_best_ms'] or float('nan'):.4f} ms  | bf16 torch "
                  f"{rec['torch_bf16_gbs']:7.0f} GB/s {rec['torch_bf16_ms']:.4f} ms"
                  f"  cfg={rec['w4a16_best_config']}")
    grouped = []
    for name in ("expert_up", "expert_down"):
        if name not in args.shapes:
            continue
        n, k = SHAPES[name]
        for tokens in (1, 16, 64):
            rec = bench_grouped(n, k, tokens, calls, reps)
            grouped.append(rec)
            print(f"grouped {name:11s} tokens={tokens:3d} active={rec['active_experts']:3d} "
                  f"{rec['gbs']:7.0f} GB/s {rec['ms']:.4f} ms rel_err={rec['rel_err']:.1e}")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": props.name, "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_gbs": copy_gbs, "dense": dense, "grouped": grouped,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
