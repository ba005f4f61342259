"""Causal GQA attention of the Nemotron-H target (no RoPE, no q/k norm); the attention itself
runs in the batch's attention backend (``blockspec.attention``) over the paged KV pool."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from blockspec.layers.linear import QuantPlan, build_linear
from blockspec.configs.nemotron_h import NemotronHConfig

if TYPE_CHECKING:
    from blockspec.forward_metadata import ForwardMetadata


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

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, cache_index: int) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        out = meta.attn.forward(q, k, v, meta.kv.k[cache_index], meta.kv.v[cache_index], meta,
                                scale=self.scale, causal=True)
        return self.o_proj(out.reshape(T, -1))
