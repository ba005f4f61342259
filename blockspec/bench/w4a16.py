"""W4A16 NVFP4 GEMM variants on Lightning shapes: check, time, pick the winner.

    python -m blockspec.bench.w4a16 --out w4a16.json [--quick] [--jobs 8]

For every shape (N x K) and M in {1, 4, 8, 16, 64}, each kernel variant (``v2``,
``v2t``, ``v2w``; see ``blockspec.kernels.w4a16``) runs with its default tile config and a
few alternatives.  Every (variant, config) is first checked against the pure-torch reference
(relative error <= 1e-2); one that is wrong or fails to compile is skipped and reported, never
fatal.  Times are medians of CUDA-graph replays (launch overhead excluded), reported as GB/s of
the bytes each GEMM must move (packed weight + E4M3 scales + x + y; bf16 weight + x + y for
torch's bf16 matmul) and as fractions of the measured HBM read bandwidth and of a nominal
4.2 TB/s.  The grouped MoE GEMM (128 experts, top-6) is timed the same way.

Kernels are compiled first in ``--jobs`` worker processes (they land in Triton's on-disk cache),
so the sweep stays within a few minutes.  The JSON holds every measurement, the best
(variant, config) per (shape, M), and the recommended default variant (``recommendation``);
flip it with ``BLOCKSPEC_W4A16_VARIANT``.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from typing import Callable

import torch

from blockspec.bench.timing import graph_time_ms
from blockspec.kernels import w4a16 as tw
from blockspec.layers.moe import sort_by_expert
from blockspec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from blockspec.kernels.w4a16_layout import to_kernel_layout

SHAPES = {  # name: (N, K)
    "expert_up": (1856, 2688),
    "expert_down": (2688, 1856),
    "shared_expert_up": (3712, 2688),
    "lm_head": (131072, 2688),
}
MS = (1, 4, 8, 16, 64)
GROUPED = {"expert_up": (1, 16, 64), "expert_down": (1, 16, 64)}  # tokens per shape
EXPERTS, TOP_K = 128, 6
NOMINAL_GBS = 4200.0  # nominal H200 read bandwidth, a second yardstick for the fractions
TOL = 1e-2

# Alternatives tried besides each variant's default config ({}); chosen to span the axes that
# matter (rows per CTA, K block, warps, pipeline depth, in-CTA K slices, split-K) without
# compiling a full grid.
WIDE_N = {  # lm_head
    "v2": [{}, {"num_warps": 4}, {"num_stages": 2}, {"num_stages": 4}, {"block_n": 64},
           {"block_n": 128, "block_k": 64, "num_warps": 4},
           {"block_n": 256, "block_k": 64, "num_warps": 8},
           {"block_n": 128, "block_k": 128, "num_warps": 8},
           {"block_n": 64, "block_k": 64, "k_slices": 4, "num_warps": 4}],
    "v2w": [{}, {"block_n": 256, "block_k": 64, "num_warps": 8},
            {"block_n": 128, "block_k": 64}, {"num_stages": 4}],
    "v2t": [{}],
}
NARROW_N = {  # experts and the shared expert
    "v2": [{}, {"block_n": 32}, {"block_n": 64, "block_k": 64, "k_slices": 4},
           {"block_n": 128}, {"split_k": 1}, {"split_k": 2}, {"split_k": 4}, {"split_k": 8},
           {"num_stages": 4}, {"num_warps": 2}],
    "v2w": [{}, {"block_n": 128}],
    "v2t": [{}],
}
M64_EXTRA = {"v2": [{"block_m": 16}, {"block_m": 64}]}  # M = 64 only (default: 32 or 64)
GROUPED_CFGS = {
    "v2": [{}, {"block_n": 32}, {"block_n": 64, "block_k": 64, "k_slices": 4}],
    "v2w": [{}],
    "v2t": [{}],
}
QUICK = {"v2": [{}], "v2w": [{}], "v2t": [{}]}


def read_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """HBM read bandwidth: bytes / time of a read-only reduction over a tensor far above L2."""
    a = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    ms = graph_time_ms(lambda: a.sum(), calls=5, reps=10)
    return nbytes / (ms * 1e-3) / 1e9


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, counting the bytes read *and* written."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = graph_time_ms(lambda: b.copy_(a), calls=5, reps=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _cfg_name(variant: str, cfg: dict) -> str:
    return variant + ("" if not cfg else ":" + ",".join(f"{k}={v}" for k, v in cfg.items()))


def _plan(quick: bool, shapes: list[str]) -> tuple[list[tuple], list[tuple]]:
    """(dense tasks, grouped tasks); a task is (shape, M or tokens, variant, cfg)."""
    dense, grouped = [], []
    for name in shapes:
        table = QUICK if quick else (WIDE_N if SHAPES[name][0] >= 8192 else NARROW_N)
        for m in MS:
            for variant, cfgs in table.items():
                extra = M64_EXTRA.get(variant, []) if m > 32 and not quick else []
                dense += [(name, m, variant, cfg) for cfg in cfgs + extra]
        for tokens in GROUPED.get(name, ()):
            for variant, cfgs in (QUICK if quick else GROUPED_CFGS).items():
                grouped += [(name, tokens, variant, cfg) for cfg in cfgs]
    return dense, grouped


# ------------------------------------------------------------------------------- problems
_CACHE: dict = {}


def _dense_problem(name: str) -> tuple:
    """Packed weights of one shape (made once per process), plus the exact bf16 weight."""
    if ("dense", name) not in _CACHE:
        n, k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(n * 131 + k)
        packed, scale, scale2 = quantize_nvfp4(
            (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16())
        w_bf16 = dequantize_nvfp4(packed, scale, scale2, torch.bfloat16)
        packed = to_kernel_layout(packed)
        _CACHE.clear()  # one shape at a time: lm_head alone is ~1 GB with its bf16 copy
        _CACHE[("dense", name)] = (packed, scale, scale2, w_bf16)
    return _CACHE[("dense", name)]


def _grouped_problem(name: str) -> tuple:
    if ("grouped", name) not in _CACHE:
        n, k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(n + k)
        parts = [quantize_nvfp4((torch.randn(n, k, device="cuda", generator=g) * 0.02)
                                .bfloat16()) for _ in range(EXPERTS)]
        _CACHE.clear()
        w, s, s2 = (torch.stack(t) for t in zip(*parts))
        _CACHE[("grouped", name)] = (to_kernel_layout(w), s, s2)
    return _CACHE[("grouped", name)]


def _dense_inputs(name: str, m: int) -> tuple:
    packed, scale, scale2, w_bf16 = _dense_problem(name)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, SHAPES[name][1], device="cuda", generator=g).bfloat16()
    return x, packed, scale, scale2, w_bf16


def _grouped_inputs(name: str, tokens: int) -> tuple:
    w, s, s2 = _grouped_problem(name)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    topk = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=g)[:TOP_K]
                        for _ in range(tokens)])
    order, offsets = sort_by_expert(topk, EXPERTS)
    x = torch.randn(tokens, SHAPES[name][1], device="cuda", generator=g).bfloat16()
    x = x[order // TOP_K].contiguous()
    return x, offsets, tw.grouped_blocks(offsets, x.shape[0]), w, s, s2


def _dense_call(task: tuple) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    name, m, variant, cfg = task
    x, packed, scale, scale2, w_bf16 = _dense_inputs(name, m)
    return (lambda: tw.w4a16_linear(x, packed, scale, scale2, variant=variant, **cfg),
            x @ w_bf16.T)


def _grouped_call(task: tuple) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    name, tokens, variant, cfg = task
    x, offsets, blocks, w, s, s2 = _grouped_inputs(name, tokens)
    return (lambda: tw.grouped_w4a16(x, offsets, w, s, s2, blocks=blocks, variant=variant,
                                     **cfg),
            lambda: tw.grouped_w4a16_reference(x, offsets, w, s, s2))


def _warm(task: tuple) -> tuple[tuple, str | None]:
    """Worker: compile (and run once) one task so the main process finds it in the cache."""
    kind, rest = task[0], task[1:]
    try:
        fn = (_dense_call(rest) if kind == "dense" else _grouped_call(rest))[0]
        fn()
        torch.cuda.synchronize()
        return task, None
    except Exception as e:  # noqa: BLE001 - reported, the main process retries and records it
        return task, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def precompile(tasks: list[tuple], jobs: int) -> dict:
    """Compile every task's kernel in ``jobs`` processes (Triton's disk cache is shared)."""
    if jobs <= 1 or not tasks:
        return {}
    errors = {}
    ctx = mp.get_context("spawn")
    with ctx.Pool(jobs) as pool:  # tasks are sorted by shape: workers reuse their weights
        for task, err in pool.imap_unordered(_warm, tasks, chunksize=max(1, len(tasks) //
                                                                         (4 * jobs))):
            if err:
                errors[task] = err
    return errors


# ------------------------------------------------------------------------------- measuring
def _gbs(nbytes: int, ms: float | None) -> float | None:
    return None if ms is None else nbytes / (ms * 1e-3) / 1e9


def measure(fn: Callable[[], torch.Tensor], ref: torch.Tensor, calls: int,
            reps: int) -> dict:
    """Check ``fn`` against ``ref``, then time it; errors become a record, not an exception."""
    try:
        err = _rel(fn(), ref)
        if not math.isfinite(err) or err > TOL:
            return {"ok": False, "error": f"wrong result: rel err {err:.3g} > {TOL}"}
        return {"ok": True, "rel_err": err, "ms": graph_time_ms(fn, calls, reps)}
    except Exception as e:  # noqa: BLE001 - a config the compiler rejects, a launch failure
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        return {"ok": False, "error": f"{type(e).__name__}: {msg}"}


def _record_run(rec: dict, r: dict, variant: str, cfg: dict, read_gbs: float) -> None:
    """Label one timed (or failed) run and add its bandwidth figures to the shape's record."""
    r.update(variant=variant, config=cfg, name=_cfg_name(variant, cfg))
    if r["ok"]:
        r["gbs"] = _gbs(rec["w4a16_bytes"], r["ms"])
        r["frac_read"] = r["gbs"] / read_gbs
        r["frac_nominal"] = r["gbs"] / NOMINAL_GBS
    rec["runs"].append(r)


def bench_dense(tasks: list[tuple], read_gbs: float, calls: int, reps: int) -> list[dict]:
    recs: dict[tuple, dict] = {}
    for name, m, variant, cfg in tasks:
        key = (name, m)
        n, k = SHAPES[name]
        fn, ref = _dense_call((name, m, variant, cfg))
        if key not in recs:
            x, packed, scale, scale2, w_bf16 = _dense_inputs(name, m)
            io = m * k * 2 + m * n * 2
            torch_ms = graph_time_ms(lambda: x @ w_bf16.T, calls, reps)
            recs[key] = {"shape": name, "N": n, "K": k, "M": m,
                         "w4a16_bytes": packed.numel() + scale.numel() + io,
                         "bf16_bytes": w_bf16.numel() * 2 + io,
                         "torch_bf16_ms": torch_ms,
                         "torch_bf16_gbs": _gbs(w_bf16.numel() * 2 + io, torch_ms),
                         "runs": []}
        _record_run(recs[key], measure(fn, ref, calls, reps), variant, cfg, read_gbs)
    return [_summarize(rec) for rec in recs.values()]


def bench_grouped(tasks: list[tuple], read_gbs: float, calls: int, reps: int) -> list[dict]:
    recs: dict[tuple, dict] = {}
    for name, tokens, variant, cfg in tasks:
        key = (name, tokens)
        n, k = SHAPES[name]
        fn, ref_fn = _grouped_call((name, tokens, variant, cfg))
        if key not in recs:
            x, offsets, _, w, s, s2 = _grouped_inputs(name, tokens)
            active = int((offsets[1:] > offsets[:-1]).sum())
            nbytes = active * (n * k // 2 + n * k // 16) + x.numel() * 2 + x.shape[0] * n * 2
            recs[key] = {"shape": name, "N": n, "K": k, "tokens": tokens, "experts": EXPERTS,
                         "top_k": TOP_K, "active_experts": active, "w4a16_bytes": nbytes,
                         "ref": ref_fn(), "runs": []}
        _record_run(recs[key], measure(fn, recs[key]["ref"], calls, reps), variant, cfg, read_gbs)
    out = []
    for rec in recs.values():
        del rec["ref"]
        out.append(_summarize(rec))
    return out


def _summarize(rec: dict) -> dict:
    """Add per-variant best/default times and the overall best to a record."""
    ok = [r for r in rec["runs"] if r["ok"]]
    rec["failed"] = [{"name": r["name"], "error": r["error"]} for r in rec["runs"]
                     if not r["ok"]]
    rec["variants"] = {}
    for v in sorted({r["variant"] for r in rec["runs"]}):
        mine = [r for r in ok if r["variant"] == v]
        default = next((r for r in mine if not r["config"]), None)
        best = min(mine, key=lambda r: r["ms"], default=None)
        rec["variants"][v] = {
            "default_ms": default and default["ms"], "default_gbs": default and default["gbs"],
            "best_ms": best and best["ms"], "best_gbs": best and best["gbs"],
            "best_config": best and best["config"]}
    best = min(ok, key=lambda r: r["ms"], default=None)
    rec["best"] = best and {k: best[k] for k in ("name", "variant", "config", "ms", "gbs",
                                                   "frac_read", "frac_nominal")}
    if best and rec.get("torch_bf16_ms"):
        rec["best_speedup_vs_bf16"] = rec["torch_bf16_ms"] / best["ms"]
    return rec


def recommend(records: list[dict]) -> dict:
    """Variant whose *default* config has the lowest geometric-mean time over every (shape, M)
    and grouped case where all variants ran; also the same with each variant's best config."""
    def geomean(key: str) -> dict:
        out = {}
        variants = sorted({v for rec in records for v in rec["variants"]})
        for v in variants:
            logs = []
            for rec in records:
                ms = rec["variants"].get(v, {}).get(key)
                if ms is None:
                    logs = None
                    break
                logs.append(math.log(ms))
            if logs:
                out[v] = math.exp(sum(logs) / len(logs))
        return out

    by_default, by_best = geomean("default_ms"), geomean("best_ms")
    pick = min(by_default, key=by_default.get) if by_default else "v2"
    return {"default_variant": pick, "geomean_ms_default_config": by_default,
            "geomean_ms_best_config": by_best,
            "note": "a variant missing from a geomean failed (or was wrong) somewhere: see "
                    "each record's 'failed'"}


def _print_dense(rec: dict) -> None:
    b = rec["best"]
    parts = []
    for v, d in rec["variants"].items():
        parts.append(f"{v} {d['default_gbs'] or 0:5.0f}/{d['best_gbs'] or 0:5.0f}")
    line = (f"{rec['shape']:16s} M={rec['M']:3d} | " + " ".join(parts) +
            f" | torch {rec['torch_bf16_gbs']:5.0f} GB/s {rec['torch_bf16_ms'] * 1e3:7.1f} us")
    if b:
        line += (f" | best {b['gbs']:5.0f} GB/s {b['ms'] * 1e3:7.1f} us "
                 f"({b['frac_read']:.0%} rd, {b['frac_nominal']:.0%} of 4.2T) {b['name']}")
    print(line)
    for f in rec["failed"]:
        print(f"    FAILED {f['name']}: {f['error']}")


def _print_grouped(rec: dict) -> None:
    b = rec["best"]
    parts = [f"{v} {d['default_gbs'] or 0:5.0f}/{d['best_gbs'] or 0:5.0f}"
             for v, d in rec["variants"].items()]
    line = (f"grouped {rec['shape']:11s} T={rec['tokens']:3d} act={rec['active_experts']:3d} | "
            + " ".join(parts))
    if b:
        line += f" | best {b['gbs']:5.0f} GB/s {b['ms'] * 1e3:7.1f} us {b['name']}"
    print(line)
    for f in rec["failed"]:
        print(f"    FAILED {f['name']}: {f['error']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--quick", action="store_true", help="default configs only, fewer repeats")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes that pre-compile the kernels (1: compile inline)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    t0 = time.time()
    calls, reps = (10, 5) if args.quick else (20, 10)
    props = torch.cuda.get_device_properties(0)
    read_gbs, copy_gbs = read_bandwidth_gbs(), copy_bandwidth_gbs()
    print(f"{props.name}: HBM read {read_gbs:.0f} GB/s (read-only reduction), copy "
          f"{copy_gbs:.0f} GB/s (read + write bytes); fractions below are of the read figure "
          f"and of {NOMINAL_GBS:.0f} GB/s")
    dense_tasks, grouped_tasks = _plan(args.quick, args.shapes)
    warm = [("dense", *t) for t in dense_tasks] + [("grouped", *t) for t in grouped_tasks]
    warm_errors = precompile(warm, args.jobs)
    print(f"compiled {len(warm)} (shape, M, variant, config) cases in {time.time() - t0:.0f} s"
          f" with {args.jobs} jobs; {len(warm_errors)} failed (retried and reported below)")
    print("per variant: default-config GB/s / best-config GB/s")
    dense = bench_dense(dense_tasks, read_gbs, calls, reps)
    for rec in dense:
        _print_dense(rec)
    grouped = bench_grouped(grouped_tasks, read_gbs, calls, reps)
    for rec in grouped:
        _print_grouped(rec)
    rec_all = recommend(dense + grouped)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": props.name, "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "read_gbs": read_gbs, "copy_gbs": copy_gbs, "nominal_gbs": NOMINAL_GBS,
        "v2_default_config": {name: {m: tw.v2_default_config(*SHAPES[name], m) for m in MS}
                              for name in args.shapes},
        "dense": dense, "grouped": grouped, "recommendation": rec_all,
        "best_per_case": [{"shape": r["shape"], "M": r.get("M"), "tokens": r.get("tokens"),
                           **(r["best"] or {})} for r in dense + grouped],
        "seconds": time.time() - t0,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
    print("geomean ms, default config:", {k: round(v * 1e3, 1) for k, v in
                                          rec_all["geomean_ms_default_config"].items()}, "us")
    print("geomean ms, best config:   ", {k: round(v * 1e3, 1) for k, v in
                                          rec_all["geomean_ms_best_config"].items()}, "us")
    print(f"recommended default: {tw.VARIANT_ENV}={rec_all['default_variant']}")
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
