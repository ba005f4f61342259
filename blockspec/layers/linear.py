"""Linear layers: one factory so any projection in any model can be stored quantized.

Parameters are named exactly like checkpoint tensors (``<prefix>.weight``), so loading is a
name-for-name copy.  A quantization plan (see ``blockspec.quant``) decides per module prefix
whether the module holds dense or packed weights; models never branch on formats themselves.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
import torch.nn.functional as F

from blockspec.quant.linear import make_quant_linear


class QuantPlan(Protocol):
    """What a model needs to know about a checkpoint's quantization: one format per module."""

    def format_for(self, prefix: str) -> str | None:
        """``None`` for a dense module, else a format name such as ``"w4a16_nvfp4"``."""


class Linear(nn.Module):
    """y = x W^T (+ b), W stored [out, in] like nn.Linear and HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as a dense [out, in] matrix (already dense here; ``dtype`` casts it, as
        the quantized linears' ``dense_weight`` dequantizes to it)."""
        return self.weight if dtype is None else self.weight.to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def build_linear(prefix: str, in_features: int, out_features: int, bias: bool = False,
                 quant: QuantPlan | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """A dense ``Linear`` or, when ``quant`` names a format for ``prefix``, a quantized one."""
    fmt = quant.format_for(prefix) if quant is not None else None
    if fmt is None:
        return Linear(in_features, out_features, bias=bias, dtype=dtype)
    return make_quant_linear(fmt, in_features, out_features, bias=bias, dtype=dtype, prefix=prefix)
