"""Load-only probes of the CUDA W4A16 kernel's memory pattern at a 7-token verify's up call
(38 experts of 1856 x 2688 NVFP4: 107 MB), to tell whether the pattern or the work between
the loads holds the kernel at ~60 % of DRAM peak. Each probe runs the kernel's grid (one CTA
per expert and 32 rows, 4 warps splitting K round-robin) but only loads and XORs the bytes:

    lane8+scale   8 B a lane per row and 64-K unit, and its scale byte (the kernel's loads)
    lane8         the same without the scale bytes
    lane16+scale  16 B a lane per row and 128-K unit, and its 2 scale bytes
    lane16        the same without the scale bytes
    stream        the same bytes as one contiguous copy-like read (16 B a thread)

Timed by CUDA-graph replay (``bench_w4a16_cuda.time_graph``) over 4 copies of the weights (so every call reads DRAM); prints
one JSON line per probe with µs and TB/s of the bytes each one reads.

    python scripts/probe_w4a16_loads.py [--unroll 2]
"""
from __future__ import annotations

import argparse
import json

import torch

from bench_w4a16_cuda import time_graph  # scripts/: the graph-replay timer

from blockspec.kernels import w4a16_cuda as tc

SRC = r"""
#define U32 unsigned int
extern "C" __global__ void __launch_bounds__(128) probe(
    const unsigned char* __restrict__ w, const unsigned char* __restrict__ s,
    U32* __restrict__ out, int N, int K) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int e = blockIdx.x, n0 = blockIdx.y * 32;
  const long long sw = K / 2, ss = K / 16;
  const unsigned char* pw = w + (long long)e * N * sw;
  const unsigned char* ps = s + (long long)e * N * ss;
  U32 acc = 0;
#if MODE == 4
  // the CTA's 32 rows as one contiguous span, 16 B a thread a step
  const unsigned char* base = pw + (long long)n0 * sw;
  const int span = (int)(32 * sw), sspan = (int)(32 * ss);
#pragma unroll UNROLL
  for (int o = tid * 16; o < span; o += 128 * 16) {
    uint4 v = __ldg((const uint4*)(base + o));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int o = tid * 4; o < sspan; o += 128 * 4) acc ^= __ldg((const U32*)(ps + (long long)n0 * ss + o));
#else
  const int UB = (MODE >= 2) ? 128 : 64;          // K per unit
  const int units = K / UB;
#pragma unroll UNROLL
  for (int u = warp; u < units; u += 4) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const long long row = n0 + 8 * r + g;
      if (row >= N) continue;
#if MODE >= 2
      uint4 v = __ldg((const uint4*)(pw + row * sw + (UB / 2) * u + 16 * t));
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
#if MODE == 2
      acc ^= __ldg((const unsigned short*)(ps + row * ss + 8 * u + 2 * t));
#endif
#else
      uint2 v = __ldg((const uint2*)(pw + row * sw + (UB / 2) * u + 8 * t));
      acc ^= v.x ^ v.y;
#if MODE == 0
      acc ^= __ldg(ps + row * ss + 4 * u + t);
#endif
#endif
    }
  }
#endif
  out[(blockIdx.x * gridDim.y + blockIdx.y) * 128 + tid] = acc;
}
"""
MODES = {"lane8+scale": 0, "lane8": 1, "lane16+scale": 2, "lane16": 3, "stream": 4}


def compile_probe(mode: int, unroll: int):
    from torch.cuda import _utils as cuda_utils
    major, minor = torch.cuda.get_device_capability()
    cubin = tc.nvrtc_cubin(tc._nvrtc_library(cuda_utils),
                           f"#define MODE {mode}\n#define UNROLL {unroll}\n" + SRC,
                           f"sm_{major}{minor}")
    return cuda_utils._cuda_load_module(cubin, ["probe"])["probe"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--experts", type=int, default=38)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    n, k, e = 1856, 2688, a.experts
    ws = [torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
          for _ in range(a.copies)]
    ss = [torch.randint(0, 256, (e, n, k // 16), dtype=torch.uint8, device="cuda")
          for _ in range(a.copies)]
    grid = (e, -(-n // 32), 1)
    out = torch.empty(grid[0] * grid[1] * 128, dtype=torch.int32, device="cuda")
    for name, mode in MODES.items():
        fn = compile_probe(mode, a.unroll)
        scale = mode in (0, 2, 4)
        nbytes = e * n * k // 2 + (e * n * k // 16 if scale else 0)
        us = time_graph(lambda i, fn=fn: fn(grid=grid, block=(128, 1, 1),
                                            args=[ws[i], ss[i], out, n, k]), a.copies, a.reps)
        print(json.dumps({"probe": name, "unroll": a.unroll, "us": round(us, 2),
                          "MB": round(nbytes / 1e6, 1), "TBps": round(nbytes / us / 1e6, 3),
                          "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
