"""The draft context write in one launch after one GEMM (as sglang's DFlash worker does).

Every committed row's target features become, per draft layer, K = rope(k_norm(k_proj(c))) and
V = v_proj(c), stored at the row's slot of that layer's context pool. Per layer the reference
(``DFlashDraftModel.write_context``) is a GEMM, a norm, a rotary and two index writes; a
speculative step pays that for every draft layer. Here the k/v weights of all layers are one
stacked GEMM (``DFlashDraftModel.fuse``) and this kernel does the norms, rotations and writes
of every (row, layer) at once.
"""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_draft_kv_kernels.py")


def write_draft_kv(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   k_norm: torch.Tensor, inv_freq: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor, eps: float) -> None:
    """``kv [N, L * 2 * heads * d]`` (per layer: K heads then V heads), ``positions``/``slots``
    ``[N]``, ``k_norm [L, d]``, ``inv_freq [L, d/2]`` fp32, pools ``[L, slots, heads, d]``
    (contiguous, written in place)."""
    n = kv.shape[0]
    layers, _, heads, d = k_pool.shape
    if kv.shape[-1] != layers * 2 * heads * d or k_pool.shape != v_pool.shape:
        raise ValueError(f"write_draft_kv: kv {tuple(kv.shape)} does not hold K and V of "
                         f"{layers} layers x {heads} heads x {d} for pools {tuple(k_pool.shape)}")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("write_draft_kv: the context pools must be contiguous")
    if n == 0:
        return
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    if interpreting():           # the interpreter mishandles views with a storage offset
        kv = kv.clone()
    pos = positions.reshape(n).contiguous()
    slots = slots.reshape(n).contiguous()
    half = d // 2
    load_kernels(_KERNELS)._draft_kv_kernel[(n, layers)](
        kv, pos, slots, k_norm.contiguous(), inv_freq.to(torch.float32).contiguous(), k_pool,
        v_pool, kv.stride(0), k_pool.stride(0), k_pool.stride(1), heads, half, float(eps),
        BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(half),
        **({} if interpreting() else {"num_warps": 4, "enable_fp_fusion": False}))
