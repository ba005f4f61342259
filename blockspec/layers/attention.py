"""Causal GQA attention over a paged KV pool (Nemotron-H: no RoPE, no q/k norm).

The reference ("torch") backend writes the new rows' K/V into the pool, gathers each
request's context through its slot table into a padded batch and runs SDPA with an explicit
causal mask, so prefill, decode and verify are one code path.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from blockspec.runtime.metadata import ForwardBatch
from blockspec.layers.linear import QuantPlan, build_linear
from blockspec.models.nemotron_h_config import NemotronHConfig


def paged_causal_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           fb: ForwardBatch, scale: float) -> torch.Tensor:
    """q [T,Hq,D] for the new rows; pools [slots,Hkv,D] already hold the new rows' K/V.
    Returns [T,Hq,D]."""
    B, qmax = fb.batch_size, max(fb.q_lens)
    Hq, D = q.shape[1], q.shape[2]
    qp = q.new_zeros(B, qmax, Hq, D)
    qp[fb.row_batch, fb.row_offset] = q
    k = k_pool[fb.ctx_slots]                                   # [B,L,Hkv,D]
    v = v_pool[fb.ctx_slots]
    L = k.shape[1]
    dev = q.device
    prefix = torch.tensor(fb.prefix_lens, device=dev)
    seq = prefix + torch.tensor(fb.q_lens, device=dev)
    qpos = prefix[:, None] + torch.arange(qmax, device=dev)[None]          # [B,qmax]
    kpos = torch.arange(L, device=dev)
    mask = (kpos[None, None] <= qpos[:, :, None]) & (kpos[None, None] < seq[:, None, None])
    out = F.scaled_dot_product_attention(                       # GQA without copying K/V per head
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None],
        scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[fb.row_batch, fb.row_offset]


class Attention(nn.Module):
    def __init__(self, cfg: NemotronHConfig, prefix: str, quant: QuantPlan | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        d, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = build_linear(f"{prefix}.q_proj", d, self.num_heads * self.head_dim, b, quant, dtype)
        self.k_proj = build_linear(f"{prefix}.k_proj", d, self.num_kv_heads * self.head_dim, b, quant, dtype)
        self.v_proj = build_linear(f"{prefix}.v_proj", d, self.num_kv_heads * self.head_dim, b, quant, dtype)
        self.o_proj = build_linear(f"{prefix}.o_proj", self.num_heads * self.head_dim, d, b, quant, dtype)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, fb: ForwardBatch, k_pool: torch.Tensor,
                v_pool: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        k_pool[fb.kv_slots] = k.to(k_pool.dtype)
        v_pool[fb.kv_slots] = v.to(v_pool.dtype)
        out = paged_causal_attention(q, k_pool, v_pool, fb, self.scale)
        return self.o_proj(out.reshape(T, -1))
