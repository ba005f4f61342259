"""The counter-based uniforms of ``sampling.uniforms`` in one launch. The torch form is some
hundred int64 elementwise kernels per call (five 32-bit hashes of two multiplies each), which
a sampled or simulated speculative step pays up to four times: ~0.1 ms of launches per call
on an H200, inside every CUDA graph replay."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_uniforms_kernels.py")


def uniforms_fused(seeds: torch.Tensor, counters: torch.Tensor, stream: int,
                   width: int) -> torch.Tensor:
    """Same arguments and bits as ``sampling.uniforms_reference``: [N, width] fp64."""
    n = seeds.shape[0]
    out = torch.empty(n, width, dtype=torch.float64, device=seeds.device)
    if n and width:
        load_kernels(_KERNELS)._uniforms_kernel[(n,)](
            seeds.contiguous(), counters.to(seeds.device).contiguous(), out, width,
            STREAM=int(stream), BLOCK=next_pow2(width, 2),
            **({} if interpreting() else {"num_warps": 1}))
    return out
