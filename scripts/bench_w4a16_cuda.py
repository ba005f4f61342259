"""The MoE pair calls of a decode step at Lightning's expert shapes: the CUDA kernel
(``kernels/w4a16_cuda.py``) at each tile shape against the Triton pair kernel, per call and
in GB/s of the distinct experts' bytes; then dense calls of up to 16 rows (the kernel's dense
mode against ``w4a16_linear``'s Triton kernel).

Each measurement replays a CUDA graph of ``--calls`` launches over one stack of 128 routed
experts + 2 shared slices, every launch with its own random top-6 routing (so the experts'
bytes come from DRAM, as in a forward's 23 layers). One JSON line per (tokens, projection,
kernel) on stdout; the best tile per (projection, tokens) against Triton on stderr.
``--write-table F`` writes those picks as the kernel's tile table (the format of
``blockspec/kernels/w4a16_cuda_tiles.json``): the best tile per call shape, or "triton" where
the Triton kernel was faster, so the dispatch sends those calls back to it.

    python scripts/bench_w4a16_cuda.py --tokens 1,4,7,8,16 [--write-table T.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from blockspec.kernels import w4a16 as tw
from blockspec.kernels import w4a16_cuda as tc

SHAPES = {"up": (1856, 2688), "down": (2688, 1856)}   # (N, K) of a Lightning expert
# (N, K, a global scale per output row) of dense calls: the published-size draft's fused
# projections (bench/draft_presets.py) and the W4A16 LM head
DENSE = {"draft_qkv": (6144, 2688, True), "draft_o": (2688, 4096, False),
         "draft_gate_up": (10752, 2688, True), "draft_down": (2688, 5376, False),
         "lm_head": (131072, 2688, False)}
EXPERTS, SHARED, TOPK = 128, 2, 6


def _stack(n: int, k: int, experts: int = EXPERTS + SHARED
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed bytes and sane E4M3 scales (speed does not depend on the values)."""
    e = experts
    w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
    s = torch.randint(0x28, 0x40, (e, n, k // 16), dtype=torch.uint8, device="cuda")
    return w, s.view(torch.float8_e4m3fn), torch.rand(e, device="cuda") * 1e-2 + 1e-3


def _routings(tokens: int, calls: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)])
            .to("cuda") for _ in range(calls)]


def time_graph(fn, calls: int, reps: int) -> float:
    """Mean µs per call of ``fn(i)`` for i < calls, replayed in one graph."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,7,8,16")
    ap.add_argument("--tiles", default="1x4x1,2x4x1,2x8x1,1x8x1,4x4x1,2x2x1,1x4x2,2x4x2,"
                                       "2x8x2,2x4x3,1x8x2,1x16x1,1x16x2",
                    help="CUDA tile shapes m_tiles x k_warps x prefetch")
    ap.add_argument("--dense-rows", default="1,7,8")
    ap.add_argument("--calls", type=int, default=23)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--write-table", default=None, help="write the picks as a tile table here")
    args = ap.parse_args()
    picks: list[dict] = []
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    for proj, (n, k) in SHAPES.items():
        w, s, s2 = _stack(n, k)
        ws2 = s2.float()
        expert_bytes = n * k // 2 + n * k // 16
        for tokens in [int(t) for t in args.tokens.split(",")]:
            ids = _routings(tokens, args.calls, seed=tokens)
            rows = tokens * (TOPK + SHARED)
            xs = [torch.randn(rows if proj == "down" else tokens, k, device="cuda",
                              dtype=torch.bfloat16) for _ in range(args.calls)]
            distinct = sum(len(set(i.reshape(-1).tolist())) + SHARED for i in ids) / len(ids)
            common = dict(x_per_pair=proj == "down", relu2=proj == "up", distinct=True,
                          shared_parts=SHARED)

            def triton(i):
                return tw._launch_v2(
                    xs[i], w, s, ws2, None, tokens * TOPK + (SHARED if tokens > 1 else
                                                             tokens * SHARED),
                    16, n, k, torch.bfloat16, "v2", relu2=common["relu2"],
                    pairs={"ids": ids[i], "x_per_pair": common["x_per_pair"],
                           "dedup": tokens > 1, "distinct": True, "shared": SHARED,
                           "rows": rows})

            runs = [("triton", triton)]
            for mt, kw, pf in tiles:
                runs.append((f"cuda {mt}x{kw}x{pf}", lambda i, mt=mt, kw=kw, pf=pf:
                             tc.pair_w4a16_cuda(xs[i], ids[i], w, s, ws2, rows=rows, m_tiles=mt,
                                                k_warps=kw, prefetch=pf, **common)))
            picks.append(_report({"proj": proj, "tokens": tokens}, runs, args, expert_bytes,
                                 distinct) | {"mode": "pairs", "n": n, "k": k})
    picks += dense(args, tiles)
    if args.write_table:
        Path(args.write_table).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
             "entries": table_entries(picks)}, indent=1) + "\n")


def table_entries(picks: list[dict]) -> list[dict]:
    """The tile table's entries from the bench's picks ({mode, n, k, tokens, best, best_us,
    triton_us}): the best CUDA tile where it beat the Triton kernel, else None ("triton")."""
    out = []
    for p in sorted(picks, key=lambda p: (p["mode"], p["n"], p["k"], p["tokens"])):
        wins = p["best_us"] < p["triton_us"]
        out.append({"mode": p["mode"], "n": p["n"], "k": p["k"], "tokens": p["tokens"],
                    "tile": [int(v) for v in p["best"].split()[-1].split("x")] if wins else None,
                    "us": p["best_us"], "triton_us": p["triton_us"]})
    return out


def dense(args, tiles) -> list[dict]:
    """Dense W4A16 calls of up to 16 rows (the published-size draft's projections, the LM
    head): the CUDA kernel's dense mode at each tile against ``w4a16_linear``'s Triton kernel
    with its tuned table, over enough weight copies that each call reads DRAM."""
    picks = []
    for name, (n, k, per_row) in DENSE.items():
        wbytes = n * k // 2 + n * k // 16
        copies = max(2, min(args.calls, int(256e6 // wbytes) + 1))
        ws = [_stack(n, k, experts=1) for _ in range(copies)]
        scales = [torch.rand(n, device="cuda") * 1e-2 + 1e-3 if per_row else s2[0]
                  for _, _, s2 in ws]
        for rows in [int(t) for t in args.dense_rows.split(",")]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            runs = [("triton", lambda i: tw.w4a16_linear(
                x, ws[i % copies][0][0], ws[i % copies][1][0], scales[i % copies],
                variant="v2"))]
            for mt, kw, pf in tiles:
                runs.append((f"cuda {mt}x{kw}x{pf}", lambda i, mt=mt, kw=kw, pf=pf:
                             tc.dense_w4a16_cuda(x, ws[i % copies][0][0], ws[i % copies][1][0],
                                                 scales[i % copies].reshape(-1).float(),
                                                 relu2=False, m_tiles=mt, k_warps=kw,
                                                 prefetch=pf)))
            picks.append(_report({"proj": name, "tokens": rows}, runs, args, wbytes, 1.0)
                         | {"mode": "dense", "n": n, "k": k})
    return picks


def _report(key: dict, runs: list, args, expert_bytes: int, distinct: float) -> dict:
    ref = runs[0][1](0).float()
    times = {}
    for name, fn in runs:
        err = ((fn(0).float() - ref).norm() / ref.norm()).item()
        us = times[name] = time_graph(fn, args.calls, args.reps)
        print(json.dumps({**key, "kernel": name, "us": round(us, 2),
                          "distinct_experts": round(distinct, 1),
                          "gb_s": round(distinct * expert_bytes / us / 1e3, 1),
                          "rel_err_vs_triton": round(err, 5)}), flush=True)
    best = min((n for n in times if n != "triton"), key=times.get)
    print(f"{key['proj']} {key['tokens']:2d} tokens: triton {times['triton']:.2f} us, best "
          f"{best} {times[best]:.2f} us ({times['triton'] / times[best]:.2f}x)",
          file=sys.stderr, flush=True)
    return {"tokens": key["tokens"], "best": best, "best_us": round(times[best], 2),
            "triton_us": round(times["triton"], 2)}


if __name__ == "__main__":
    main()
