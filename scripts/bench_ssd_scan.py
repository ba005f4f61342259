"""Time the Mamba-2 prefill kernels at Lightning's Mamba shapes (64 heads x 64, state 128,
8 groups, SSD chunk 128, conv width 4) for each dot precision of ``kernels/ssd_scan``, with
each result's error against the torch reference (``layers/mamba2.ssd_chunked_scan``, fp32).

    python scripts/bench_ssd_scan.py [--tokens 2048,8192] [--out scan.jsonl]

One JSON line per (tokens, kernel, precision): median ms of 20 runs (CUDA events), TFLOP/s
of the scan's counted FLOPs (as bench/flops.py counts them) and max |y - ref| / max |ref|.
"""
from __future__ import annotations

import argparse
import json

import torch

from blockspec.bench.timing import event_time_ms
from blockspec.kernels.causal_conv import causal_conv1d
from blockspec.kernels.ssd_scan import PRECISIONS, ssd_scan
from blockspec.layers.mamba2 import ssd_chunked_scan

H, P, N, G, Q, K = 64, 64, 128, 8, 128, 4


def timed(fn) -> float:
    return event_time_ms(fn, 20, torch.device("cuda"))


def scan_flops(T: int) -> int:
    full, rest = divmod(T, Q)
    per = sum(2 * q * q * N + 2 * q * q * P + 4 * q * N * P for q in [Q] * full + ([rest] if rest else []))
    return per * H


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(1, T, H, P, device=dev, generator=g).bfloat16()
        dt = torch.nn.functional.softplus(torch.randn(1, T, H, device=dev, generator=g) - 3)
        A = -torch.exp(torch.randn(H, device=dev, generator=g) * 0.5)
        B = torch.randn(1, T, G, N, device=dev, generator=g).bfloat16()
        C = torch.randn(1, T, G, N, device=dev, generator=g).bfloat16()
        s0 = torch.randn(1, H, P, N, device=dev, generator=g) * 0.1
        ref, ref_s = ssd_chunked_scan(x.float(), dt, A, B.float(), C.float(), s0, Q)
        ms = timed(lambda: ssd_chunked_scan(x.float(), dt, A, B.float(), C.float(), s0, Q))
        rows.append({"tokens": T, "kernel": "ssd_chunked_scan (torch)", "ms": ms,
                     "tflops": scan_flops(T) / ms / 1e9})
        for prec in PRECISIONS:
            y, s = ssd_scan(x, dt, A, B, C, s0, Q, precision=prec)
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            serr = ((s - ref_s).abs().max() / ref_s.abs().max()).item()
            ms = timed(lambda p=prec: ssd_scan(x, dt, A, B, C, s0, Q, precision=p))
            rows.append({"tokens": T, "kernel": "ssd_scan", "precision": prec, "ms": ms,
                         "tflops": scan_flops(T) / ms / 1e9, "rel_err_y": err,
                         "rel_err_state": serr})
        conv_dim = H * P + 2 * G * N
        xbc = torch.randn(1, T, conv_dim, device=dev, generator=g).bfloat16()
        win = torch.randn(1, conv_dim, K - 1, device=dev, generator=g).bfloat16()
        w = torch.randn(conv_dim, 1, K, device=dev, generator=g).bfloat16()
        bias = torch.randn(conv_dim, device=dev, generator=g).bfloat16()
        ms = timed(lambda: causal_conv1d(xbc, win, w, bias))
        gbs = (2 * xbc.numel() * 2) / ms / 1e6
        rows.append({"tokens": T, "kernel": "causal_conv1d", "ms": ms, "gb_per_s": gbs})
    for r in rows:
        print(json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v)
                          for k, v in r.items()}), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
