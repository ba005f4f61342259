"""Tile sweep of the NVFP4 dequant kernel (``blockspec/kernels/nvfp4_dequant.py``) on
Lightning's prefill shapes: the routed experts' stacks (128 x 2688 x 1856, 128 x 1856 x 2688)
and the shared expert (3712 x 2688).

    python scripts/bench_nvfp4_dequant.py --out dequant.jsonl          # one GPU, < 1 minute

Each config's output is compared bit for bit with the shipped tile's, which is first checked
against the torch reference; then timed with CUDA events (median of ``--reps``). One JSON line
per point: ms and GB/s (packed bytes and scales read plus 16-bit weights written), against the
HBM rate of a device-to-device copy measured in the same run.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.bench.timing import event_time_ms
from blockspec.kernels import nvfp4_dequant as nd

SHAPES = {"routed_down": (128, 2688, 1856), "routed_up": (128, 1856, 2688),
          "shared_up": (1, 3712, 2688)}
GRID = {"block_n": (16, 32, 64), "block_w": (32, 64, 128), "num_warps": (4, 8)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = event_time_ms(lambda: copy_dst.copy_(copy_src), args.reps, dev)
    hbm = 2 * copy_src.numel() / (copy_ms * 1e-3) / 1e9
    print(f"device copy: {hbm:.0f} GB/s (read + write)")
    with open(args.out, "a") as f:
        for name, (e, n, k) in SHAPES.items():
            g = torch.Generator(device=dev).manual_seed(n + k)
            w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev, generator=g)
            s = (torch.rand((e, n, k // 16), device=dev, generator=g) + 0.5).to(torch.float8_e4m3fn)
            s2 = torch.rand(e, device=dev, generator=g) * 0.01
            want = nd.nvfp4_dequant(w, s, s2)
            ref = nd.nvfp4_dequant_reference(w, s, s2)
            shipped_ok = torch.equal(want.view(torch.int16), ref.view(torch.int16))
            del ref
            moved = w.numel() + s.numel() + 2 * e * n * k
            best = None
            for vals in itertools.product(*GRID.values()):
                cfg = dict(zip(GRID, vals))
                rec = {"shape": name, "e": e, "n": n, "k": k, **cfg, "hbm_gbs": hbm}
                try:
                    got = nd.nvfp4_dequant(w, s, s2, **cfg)
                    rec["exact"] = shipped_ok and torch.equal(got.view(torch.int16),
                                                              want.view(torch.int16))
                    ms = event_time_ms(lambda cfg=cfg: nd.nvfp4_dequant(w, s, s2, **cfg),
                                       args.reps, dev)
                    rec.update(ms=ms, gbs=moved / (ms * 1e-3) / 1e9)
                    if rec["exact"] and (best is None or ms < best["ms"]):
                        best = rec
                except Exception as ex:  # noqa: BLE001 (a refused config is a result)
                    rec["error"] = f"{type(ex).__name__}: {ex}"[:200]
                f.write(json.dumps(rec) + "\n")
            shipped = {"block_n": nd.BLOCK_N, "block_w": nd.BLOCK_W, "num_warps": nd.NUM_WARPS}
            print(f"{name}: shipped {shipped} exact={shipped_ok}; best "
                  + (f"{ {k: best[k] for k in GRID} } {best['ms']:.3f} ms {best['gbs']:.0f} GB/s"
                     if best else "none"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
