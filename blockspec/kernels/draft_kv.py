"""The draft's K/V writes in one launch each, after one GEMM (as sglang's DFlash worker does).

Context write: every committed row's target features become, per draft layer,
K = rope(k_norm(k_proj(c))) and V = v_proj(c), stored at the row's slot of that layer's
context pool. Per layer the reference (``DFlashDraftModel.write_context``) is a GEMM, a norm,
a rotary and two index writes; a speculative step pays that for every draft layer. Here the
k/v weights of all layers are one stacked GEMM (``DFlashDraftModel.fuse``) and
``write_draft_kv`` does the norms, rotations and writes of every (row, layer) at once.

Draft block: each draft layer's attention over the block needs q = rope(q_norm(q)) and the
block's own K/V in the cache first: two norms, two rotaries and the backend's two index writes
per layer (``draft_block_qkv_reference``); ``draft_block_qkv`` does them in one launch from the
fused q/k/v projection's output.
"""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2
from blockspec.kernels.rotary import apply_rotary_reference

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


def _check_block(qkv: torch.Tensor, q_heads: int, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, layer: int) -> tuple[int, int]:
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"draft_block_qkv: pools must be [layers, slots, kv_heads, d] alike, "
                         f"got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    if not 0 <= layer < k_pool.shape[0]:
        raise ValueError(f"draft_block_qkv: layer {layer} outside the pools' {k_pool.shape[0]}")
    kv_heads, d = k_pool.shape[2], k_pool.shape[3]
    if qkv.dim() != 2 or qkv.shape[1] != (q_heads + 2 * kv_heads) * d or d % 2:
        raise ValueError(f"draft_block_qkv: qkv must be [N, ({q_heads} + 2 x {kv_heads}) x {d}] "
                         f"(Q, K, V heads of an even head dim), got {tuple(qkv.shape)}")
    return kv_heads, d


def draft_block_qkv_reference(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                              q_norm: torch.nn.Module, k_norm: torch.nn.Module,
                              inv_freq: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              layer: int, q_heads: int) -> torch.Tensor:
    """The torch form of ``draft_block_qkv`` (``RMSNorm.reference``, ``apply_rotary_reference``
    and the attention backends' cache write), same arguments."""
    kv_heads, d = _check_block(qkv, q_heads, k_pool, v_pool, layer)
    n = qkv.shape[0]
    q, k, v = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = apply_rotary_reference(q_norm.reference(q.reshape(n, q_heads, d)), positions,
                               inv_freq=inv_freq)
    k = apply_rotary_reference(k_norm.reference(k.reshape(n, kv_heads, d)), positions,
                               inv_freq=inv_freq)
    k_pool[layer][slots] = k.to(k_pool.dtype)
    v_pool[layer][slots] = v.reshape(n, kv_heads, d).to(v_pool.dtype)
    return q


def draft_block_qkv(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    q_norm: torch.nn.Module, k_norm: torch.nn.Module, inv_freq: torch.Tensor,
                    k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int,
                    q_heads: int) -> torch.Tensor:
    """``qkv [N, (q_heads + 2 kv_heads) * d]`` (the fused projection: Q, K, V heads), the rows'
    ``positions`` and cache ``slots`` [N], the layer's q/k RMSNorm modules and RoPE
    ``inv_freq [d/2]``, and the draft pools ``[layers, slots, kv_heads, d]`` (contiguous,
    ``layer``'s written in place) -> q ``[N, q_heads, d]`` normalised and rotated, in qkv's
    dtype; the rows' K (normalised, rotated) and V are in the layer's pools. One launch."""
    kv_heads, d = _check_block(qkv, q_heads, k_pool, v_pool, layer)
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("draft_block_qkv: the pools must be contiguous")
    n = qkv.shape[0]
    q = torch.empty(n, q_heads, d, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    if interpreting():           # the interpreter mishandles views with a storage offset
        qkv = qkv.clone()
    half = d // 2
    load_kernels(_KERNELS)._draft_block_qkv_kernel[(n, 2)](
        qkv, positions.reshape(n).contiguous(), slots.reshape(n).contiguous(),
        q_norm.weight, k_norm.weight, inv_freq.to(torch.float32).contiguous(), q, k_pool,
        v_pool, qkv.stride(0), q.stride(0), layer * k_pool.stride(0), k_pool.stride(1),
        q_heads, kv_heads, half,
        float(q_norm.eps), float(k_norm.eps), BLOCK_HQ=next_pow2(q_heads),
        BLOCK_HKV=next_pow2(kv_heads), BLOCK_D=next_pow2(half),
        **({} if interpreting() else {"num_warps": 4, "enable_fp_fusion": False}))
    return q
