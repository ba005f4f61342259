"""The MoE combine in one launch: each token's top-k expert outputs, weighted and summed in
fp32, cast to the activation dtype, plus the shared expert's output.

In torch this is seven kernels per MoE layer (zeros, a gather of the weights, a cast, a
multiply, ``index_add_``, a cast, the shared add), which at decode batch sizes cost more in
launches than in bytes. ``moe_combine_reference`` is that torch code, kept for the tests and
for the CPU.
"""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_moe_combine_kernels.py")


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """Where each flat (token, slot) pair landed in the expert-sorted rows."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def moe_combine_reference(y: torch.Tensor, order: torch.Tensor | None, w: torch.Tensor,
                          shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``y [P, H]`` expert outputs in expert-sorted order (``order`` from ``sort_by_expert``;
    None: already in pair order, token-major), ``w [T, k]`` routing weights -> ``[T, H]`` in
    ``dtype`` (+ ``shared [T, H]``, or ``[T, S, H]``: the shared expert's output in S slices,
    summed in fp32 and rounded first)."""
    t, k = w.shape
    if order is None:
        order = torch.arange(t * k, device=y.device)
    out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    out.index_add_(0, order // k, y.float() * w.reshape(-1)[order][:, None])
    out = out.to(dtype)
    if shared is not None and shared.dim() == 3:
        shared = shared.float().sum(1).to(dtype)
    return out if shared is None else out + shared


def moe_combine(y: torch.Tensor, order: torch.Tensor | None, w: torch.Tensor,
                shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The fused form of ``moe_combine_reference`` (same arguments)."""
    t, k = w.shape
    h = y.shape[1]
    y = y if y.stride(-1) == 1 else y.contiguous()
    inv = inverse_order(order) if order is not None else y   # (unused in pair order)
    w = w.to(torch.float32).contiguous()
    out = torch.empty(t, h, dtype=dtype, device=y.device)
    if shared is not None and shared.stride(-1) != 1:
        shared = shared.contiguous()
    parts = shared.shape[1] if shared is not None and shared.dim() == 3 else 1
    block = min(1024, next_pow2(h, 16))
    load_kernels(_KERNELS)._moe_combine_kernel[(t, -(-h // block))](
        y, inv, w, shared if shared is not None else y, out, h, y.stride(0),
        shared.stride(0) if shared is not None else 0, out.stride(0),
        shared.stride(1) if parts > 1 else 0, TOPK=k, BLOCK_H=block,
        HAS_SHARED=shared is not None, SORTED=order is not None, PARTS=parts,
        **({} if interpreting() else {"num_warps": 4}))
    return out
