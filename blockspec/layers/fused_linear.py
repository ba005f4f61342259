"""Sibling projections of one input as one GEMM (vLLM's merged QKV / gate-up linears).

At decode sizes every GEMM is a weight read plus a launch (two with cuBLAS's split-K), so
q/k/v and gate/up of a draft layer cost less as one matmul over their stacked weights. The
stacked tensor is the storage: each module's weight becomes a view of its rows, so the modules
(checkpoint names, the unfused path) keep seeing the same bytes.
"""
from __future__ import annotations

import torch
from torch import nn

from blockspec.layers.linear import Linear


def fuse_linears(*modules: nn.Module) -> torch.Tensor | None:
    """The stacked ``[sum(out), in]`` weight of plain bias-free ``Linear`` modules sharing an
    input width (each module's weight re-pointed at its rows), or None when any module is
    quantized, biased or of another width."""
    if not all(type(m) is Linear and m.bias is None for m in modules):
        return None
    if len({m.weight.shape[1] for m in modules}) != 1 or len({m.weight.dtype for m in modules}) != 1:
        return None
    fused = torch.cat([m.weight.data for m in modules])
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = fused[row:row + n]
        row += n
    return fused
