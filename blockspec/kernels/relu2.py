"""relu(x)^2 (Nemotron-H's MLP activation) in one launch. torch runs it as two kernels (relu
or clamp, then square), which the decode step pays for every shared expert and every packed
expert layer: 46 launches per token on full Lightning. ``relu2_reference`` is the torch code."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.kernels.triton_loader import interpreting, load_kernels

_KERNELS = Path(__file__).with_name("_relu2_kernels.py")
_BLOCK = 1024


def relu2_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def relu2(x: torch.Tensor) -> torch.Tensor:
    """The fused form of ``relu2_reference`` (bit-identical: one fp32 square, one rounding)."""
    x = x if x.is_contiguous() else x.contiguous()
    if interpreting() and x.storage_offset():
        x = x.clone()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        load_kernels(_KERNELS)._relu2_kernel[(-(-n // _BLOCK),)](
            x, y, n, BLOCK=_BLOCK, **({} if interpreting() else {"num_warps": 4}))
    return y
