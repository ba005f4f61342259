"""Sibling projections of one input as one GEMM (vLLM's merged QKV / gate-up linears).

At decode sizes every GEMM is a weight read plus a launch (two with cuBLAS's split-K), so
q/k/v and gate/up of a draft layer cost less as one matmul over their stacked weights. The
stacked tensors are the storage: each module's weight becomes a view of its rows, so the
modules (checkpoint names, the unfused path) keep seeing the same bytes. NVFP4 projections
stack too: the W4A16 kernel takes a global scale per output row, so each keeps its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.kernels.w4a16 import w4a16_linear, w4a16_linear_reference
from blockspec.layers.linear import Linear
from blockspec.quant.linear import stack_nvfp4_rows, w4a16_runs


class FusedLinear:
    """Stacked rows of sibling projections, called as one GEMM: a dense ``weight`` [N, K], or
    an NVFP4 one (``scale`` [N, K/16], ``scale2`` [N]: one global scale per row). Not a
    module, so it never shows in a state dict."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 scale2: torch.Tensor | None = None) -> None:
        self.weight, self.scale, self.scale2 = weight, scale, scale2

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quantized:
            return F.linear(x, self.weight)
        if w4a16_runs(x):
            return w4a16_linear(x, self.weight, self.scale, self.scale2)
        return w4a16_linear_reference(x, self.weight, self.scale, self.scale2)

    def rows(self, start: int, stop: int | None = None) -> FusedLinear:
        """Rows ``start:stop`` of the stack (views, no copy)."""
        sl = slice(start, stop)
        if not self.quantized:
            return FusedLinear(self.weight[sl])
        return FusedLinear(self.weight[sl], self.scale[sl], self.scale2[sl])


def fuse_linears(*modules: nn.Module) -> FusedLinear | None:
    """The stacked projection of bias-free ``Linear`` modules (one dtype) or of bias-free
    NVFP4 ones sharing an input width, each module re-pointed at its rows; None otherwise
    (a bias, mixed kinds, FP8, another width)."""
    if all(type(m) is Linear and m.bias is None for m in modules):
        if (len({m.weight.shape[1] for m in modules}) != 1
                or len({m.weight.dtype for m in modules}) != 1):
            return None
        fused = torch.cat([m.weight.data for m in modules])
        row = 0
        for m in modules:
            n = m.weight.shape[0]
            m.weight.data = fused[row:row + n]
            row += n
        return FusedLinear(fused)
    stacked = stack_nvfp4_rows(list(modules))
    return None if stacked is None else FusedLinear(*stacked)
