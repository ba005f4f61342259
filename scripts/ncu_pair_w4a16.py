"""ncu target: the MoE W4A16 pair calls (up with relu2, down) of verifies of ``--tokens``
tokens (default 7 and 4: DFlash width 7, DSpark gamma 3) and an AR step, on random packed
experts with the shared expert's 2 slices riding. Each size runs 3 times (up, down), so
``--launch-skip 2 --launch-count 2`` profiles the first size's second pair of calls. On a
CUDA GPU with bf16 activations the calls run the CUDA kernel (``w4a16_cuda``); the Triton
one (``regex:_w4a16_v2_kernel``) serves the rest:

    ncu --clock-control none --kernel-name w4a16_cuda --launch-skip 2 \
        --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SourceCounters python3 scripts/ncu_pair_w4a16.py [--tokens 7 4 1]
"""
import argparse, sys, torch
sys.path.insert(0, "scripts")
from bench_w4a16_decode import random_nvfp4
from blockspec.kernels import w4a16 as tw
ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, nargs="+", default=[7, 4, 1])
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
E, S = 128, 2
wu = random_nvfp4((E + S, 1856, 2688), g, dev)
wd = random_nvfp4((E + S, 2688, 1856), g, dev)
for T in ap.parse_args().tokens:
    ids = torch.stack([torch.randperm(E, generator=g, device=dev)[:6] for _ in range(T)])
    x = torch.randn(T, 2688, device=dev).bfloat16()
    dd = T > 1
    for _ in range(3):
        h = tw.pair_w4a16(x, ids, *wu, dedup=dd, relu2=True, distinct=True, shared_parts=S)
        y = tw.pair_w4a16(h, ids, *wd, x_per_pair=True, dedup=dd, distinct=True, shared_parts=S)
    torch.cuda.synchronize()
    print(T, len(set(ids.flatten().tolist())), h.shape, y.shape)
