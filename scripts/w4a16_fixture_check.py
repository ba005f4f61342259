"""Every packed Linear of a ModelOpt fixture through each W4A16 variant vs the torch reference
(bf16, M in {1, 2, 7, 16}): the shapes tiny test models hit (K = 16, N not a tile multiple)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from blockspec.checkpoint import load_tensors
from blockspec.kernels import w4a16 as tw
from blockspec.kernels.w4a16_layout import to_kernel_layout

folder = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/modelopt/w4a16_nvfp4")
t = load_tensors(folder)
worst: dict[str, float] = {}
for name in sorted(n for n in t if n.endswith(".weight_scale_2")):
    p = name[: -len(".weight_scale_2")]
    w, s, s2 = (to_kernel_layout(t[p + ".weight"].cuda()), t[p + ".weight_scale"].cuda(),
                t[p + ".weight_scale_2"].cuda())
    for m in (1, 2, 7, 16):
        x = torch.randn(m, w.shape[1] * 2, device="cuda", dtype=torch.bfloat16)
        ref = tw.w4a16_linear_reference(x, w, s, s2).float()
        for v in tw.VARIANTS:
            try:
                got = tw.w4a16_linear(x, w, s, s2, variant=v).float()
                err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
            except Exception as e:  # report, keep going
                print(f"{p} M={m} {v}: FAILED {type(e).__name__}: {e}")
                err = float("inf")
            worst[v] = max(worst.get(v, 0.0), err)
            if err > 1e-2:
                print(f"{p} N={w.shape[0]} K={w.shape[1] * 2} M={m} {v}: rel err {err:.3e}")
print("worst relative error per variant:", worst)
