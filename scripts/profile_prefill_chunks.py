"""What one request's padded prefill chunk costs when replayed from its CUDA graph
(``runtime/prefill_graphs.py``), on the full quantized Lightning preset, one H200:

    python scripts/profile_prefill_chunks.py --context 32768

The request is first prefilled to ``--context`` tokens; then each bucket's chunk is timed with
CUDA events (median of 5 replays after 2) beside the host time of the call, and one replay of
each ``--profile`` size is profiled: its kernels by GPU time (random weights: it measures
speed, not text)."""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec import Engine
from blockspec.bench import presets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="nemotron-3.5-lightning", choices=sorted(presets.PRESETS))
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024, 2048])
    p.add_argument("--profile", type=int, nargs="*", default=[256, 128])
    args = p.parse_args()

    dev = torch.device("cuda")
    model = presets.build_target(args.preset, dev, torch.bfloat16, True)
    need = args.context + max(args.chunks) + 64
    engine = Engine.from_model(model, max_total_tokens=need, max_running_requests=2)
    runner, res = engine.runner, engine.memory.admit(need)
    ids = torch.randint(3, engine.config.vocab_size, (need,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    t0 = time.perf_counter()
    for at in range(0, args.context, 2048):
        runner.extend([res.slot], [at], [ids[at:min(at + 2048, args.context)]])
    torch.cuda.synchronize()
    print(f"{args.context}-token context prefilled (graphs captured) in "
          f"{time.perf_counter() - t0:.2f} s", flush=True)
    pg, at = runner.prefill_graphs, args.context

    def chunk(n: int) -> None:
        pg.extend(res.slot, at, ids[at:at + n], ())

    for n in args.chunks:
        for _ in range(2):
            chunk(n)
        times = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            chunk(n)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        h0 = time.perf_counter()
        chunk(n)
        host = time.perf_counter() - h0
        torch.cuda.synchronize()
        print(f"chunk {n}: gpu {sorted(times)[2]:.2f} ms (host call {1e3 * host:.2f} ms)",
              flush=True)
    for n in args.profile:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            chunk(n)
            torch.cuda.synchronize()
        by = defaultdict(lambda: [0.0, 0])
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                by[ev.name[:70]][0] += ev.device_time / 1e3
                by[ev.name[:70]][1] += 1
        total = sum(v[0] for v in by.values())
        print(f"--- chunk {n}: kernels total {total:.2f} ms, "
              f"{sum(v[1] for v in by.values())} launches")
        for name, (ms, count) in sorted(by.items(), key=lambda kv: -kv[1][0])[:22]:
            print(f"{ms:8.3f} ms {count:5d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
