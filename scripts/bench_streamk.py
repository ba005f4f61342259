"""The MoE pair calls of a verify: stream-K (``w4a16_streamk``) against ``pair_w4a16``'s
dedup mode, at Lightning's expert shapes, for verifies of 7 and 4 tokens (DFlash width 7,
DSpark gamma 3). Each timed CUDA graph runs ``--draws`` calls, each on its own random routing
over 128 experts (plus the shared expert's 2 slices), so the L2 holds no call's weights and the
distinct-expert count varies as in a real verify. Every config is checked against the torch
reference first.

    python scripts/bench_streamk.py [--out F.jsonl] [--tokens 7 4]
"""
import argparse, itertools, json, sys, time
import torch
sys.path.insert(0, "scripts")
from bench_w4a16_decode import random_nvfp4
from blockspec.bench.timing import graph_time_ms
from blockspec.kernels import w4a16 as tw
from blockspec.kernels.w4a16_streamk import pair_w4a16_streamk

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, nargs="+", default=[7, 4])
ap.add_argument("--draws", type=int, default=16)
ap.add_argument("--out")
a = ap.parse_args()
dev, E, S, TOPK = "cuda", 128, 2, 6
g = torch.Generator(device=dev).manual_seed(0)
W = {"up": random_nvfp4((E + S, 1856, 2688), g, dev), "down": random_nvfp4((E + S, 2688, 1856), g, dev)}
EXPERT_BYTES = 1856 * 2688 * (0.5 + 1 / 16)
GRID = {"up": [dict(block_n=bn, block_k=128, num_warps=w, num_stages=st, maxnreg=r, ctas_per_sm=c)
               for bn, w, st, r, c in itertools.product((32, 64), (1, 2, 4), (3, 4), (None, 128),
                                                        (4, 6, 8))],
        "down": [dict(block_n=bn, block_k=64, num_warps=w, num_stages=st, maxnreg=r, ctas_per_sm=c)
                 for bn, w, st, r, c in itertools.product((32, 64), (1, 2, 4), (2, 3, 4), (None, 128),
                                                          (4, 8, 12))]}
out = open(a.out, "a") if a.out else None
for T in a.tokens:
    ids = [torch.stack([torch.randperm(E, generator=g, device=dev)[:TOPK] for _ in range(T)]).int()
           for _ in range(a.draws)]
    distinct = sum(len(set(i.flatten().tolist())) for i in ids) / len(ids)
    gb = a.draws * (distinct + S) * EXPERT_BYTES / 1e9
    xs = {"up": torch.randn(T, 2688, device=dev).bfloat16(),
          "down": torch.randn(T * TOPK + T * S, 1856, device=dev).bfloat16() * 0.1}
    for proj in ("up", "down"):
        w, s, s2 = W[proj]
        x = xs[proj]
        kw = dict(x_per_pair=proj == "down", relu2=proj == "up", shared_parts=S)
        ref = tw.pair_w4a16(x, ids[0], w, s, s2, dedup=True, distinct=True, **kw)
        def run_v2():
            for i in ids:
                tw.pair_w4a16(x, i, w, s, s2, dedup=True, distinct=True, **kw)
        base = graph_time_ms(run_v2, 1, 5)
        line = dict(tokens=T, proj=proj, kernel="v2-dedup", us=base * 1e3 / a.draws,
                    gbs=gb / (base * 1e-3), distinct=distinct)
        print(json.dumps(line), flush=True)
        if out: out.write(json.dumps(line) + "\n")
        best = None
        for cfg in GRID[proj]:
            try:
                y = pair_w4a16_streamk(x, ids[0], w, s, s2, **kw, **cfg)
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 1e-2:
                    raise ValueError(f"rel err {err}")
                def run_sk():
                    for i in ids:
                        pair_w4a16_streamk(x, i, w, s, s2, **kw, **cfg)
                ms = graph_time_ms(run_sk, 1, 5)
            except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
                print("fail", proj, cfg, repr(e)[:200], flush=True)
                continue
            line = dict(tokens=T, proj=proj, kernel="streamk", cfg=cfg, us=ms * 1e3 / a.draws,
                        gbs=gb / (ms * 1e-3), x_v2=base / ms)
            if out: out.write(json.dumps(line) + "\n")
            if best is None or ms < best[0]:
                best = (ms, line)
        print("best", json.dumps(best[1]) if best else None, flush=True)
