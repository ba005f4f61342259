"""Pure-torch references of the W4A16 launchers (``kernels/w4a16.py``, which re-exports
them): the same arguments, packed weights in the kernel layout, each weight dequantized
exactly (fp32) and cast to x's dtype before a plain matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.kernels.w4a16_layout import from_kernel_layout
from blockspec.quant.nvfp4 import dequantize_nvfp4


def w4a16_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           weight_scale_2: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch ``w4a16_linear`` (same arguments, kernel layout): exact fp32 dequant, cast to
    x's dtype, ``F.linear``."""
    w = dequantize_nvfp4(from_kernel_layout(weight), weight_scale, weight_scale_2, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def pair_w4a16_reference(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
                         x_per_pair: bool = False, relu2: bool = False,
                         shared_parts: int = 0) -> torch.Tensor:
    """Pure torch ``pair_w4a16`` (same arguments, kernel layout): each output row through its
    exactly dequantized expert."""
    tokens, topk = ids.shape
    e = weight.shape[0]
    experts = ids.reshape(-1).tolist() + [e - shared_parts + s for _ in range(tokens)
                                          for s in range(shared_parts)]
    token_of = [p // topk for p in range(tokens * topk)] + [t for t in range(tokens)
                                                           for _ in range(shared_parts)]
    out = []
    for r, ex in enumerate(experts):
        w = dequantize_nvfp4(from_kernel_layout(weight[ex]), weight_scale[ex],
                             weight_scale_2.reshape(-1)[ex], dtype=x.dtype)
        row = r if x_per_pair else token_of[r]
        out.append(F.linear(x[row:row + 1], w))
    y = torch.cat(out) if out else x.new_empty((0, weight.shape[-2]))
    return torch.square(F.relu(y)) if relu2 else y


def grouped_w4a16_reference(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor,
                            weight_scale: torch.Tensor,
                            weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Pure torch ``grouped_w4a16`` (kernel layout): each expert's rows through its exactly
    dequantized weight."""
    n = weight.shape[-2]
    out = x.new_zeros((x.shape[0], n))
    offs = [int(v) for v in expert_offsets.tolist()]
    for e in range(weight.shape[0]):
        a, b = offs[e], offs[e + 1]
        if a == b:
            continue
        w = dequantize_nvfp4(from_kernel_layout(weight[e]), weight_scale[e],
                             weight_scale_2.reshape(-1)[e], dtype=x.dtype)
        out[a:b] = F.linear(x[a:b], w)
    return out
