"""Where ``torch._grouped_mm`` (one launch over every expert's rows) runs natively: the MoE's
dense stacked experts and the dequantized W4A16 experts both ask here before calling it."""
from __future__ import annotations

import torch


def grouped_mm_ok(x: torch.Tensor, *dims: int) -> bool:
    """``torch._grouped_mm`` on activations like ``x`` with weight sizes ``dims``: on CPU
    always, on CUDA for bf16 on sm90+ with every size a multiple of 16 (its alignment)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return all(d % 16 == 0 for d in dims)
