"""Nemotron-H feed-forward mixers: the dense relu^2 MLP and the routed MoE.

Routing: sigmoid scores in fp32; ``e_score_correction_bias`` only steers *which* experts are
chosen (group-limited top-k over ``n_group`` groups, each group scored by its best two);
the weights are the un-biased scores, renormalised when ``norm_topk_prob``, times
``routed_scaling_factor``. Experts are non-gated: down(relu(up(x))^2).
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from blockspec.layers.linear import QuantPlan, build_linear
from blockspec.models.nemotron_h_config import NemotronHConfig


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class ReluSquaredMLP(nn.Module):
    def __init__(self, prefix: str, hidden: int, inner: int, bias: bool,
                 quant: QuantPlan | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.up_proj = build_linear(f"{prefix}.up_proj", hidden, inner, bias, quant, dtype)
        self.down_proj = build_linear(f"{prefix}.down_proj", inner, hidden, bias, quant, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class TopkRouter(nn.Module):
    def __init__(self, cfg: NemotronHConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [T,k], weights [T,k] fp32)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)
            group_score = grouped.topk(min(2, E // self.n_group), dim=-1).values.sum(-1)
            keep = group_score.topk(self.topk_group, dim=-1).indices
            gmask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~gmask[:, :, None], float("-inf")).view(T, E)
        ids = choice.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * self.scale


class MoE(nn.Module):
    def __init__(self, cfg: NemotronHConfig, prefix: str, quant: QuantPlan | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate = TopkRouter(cfg, dtype)
        expert_in = cfg.moe_latent_size or cfg.hidden_size
        self.experts = nn.ModuleList(
            ReluSquaredMLP(f"{prefix}.experts.{e}", expert_in, cfg.moe_intermediate_size,
                           cfg.mlp_bias, quant, dtype)
            for e in range(cfg.n_routed_experts))
        self.shared_experts = (
            ReluSquaredMLP(f"{prefix}.shared_experts", cfg.hidden_size,
                           cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias, quant, dtype)
            if cfg.n_shared_experts else None)
        self._grouped = None   # stacked packed experts, set by prepare_grouped()
        self.latent = cfg.moe_latent_size is not None
        if self.latent:
            self.fc1_latent_proj = build_linear(f"{prefix}.fc1_latent_proj", cfg.hidden_size,
                                                cfg.moe_latent_size, cfg.mlp_bias, quant, dtype)
            self.fc2_latent_proj = build_linear(f"{prefix}.fc2_latent_proj", cfg.moe_latent_size,
                                                cfg.hidden_size, cfg.mlp_bias, quant, dtype)

    def prepare_grouped(self) -> bool:
        """When every routed expert is packed NVFP4, stack them once (buffers become views) so
        GPU steps run all experts of a projection in one grouped W4A16 kernel. Call after
        loading, on the final device."""
        from blockspec.quant.linear import NVFP4Linear, stack_nvfp4_experts

        ups = [e.up_proj for e in self.experts]
        downs = [e.down_proj for e in self.experts]
        if not all(isinstance(m, NVFP4Linear) for m in ups + downs):
            return False
        self._grouped = (stack_nvfp4_experts(ups), stack_nvfp4_experts(downs))
        return True

    def _use_grouped(self, h: torch.Tensor) -> bool:
        if self._grouped is None or not h.is_cuda:
            return False
        from blockspec.quant.triton_w4a16 import triton_available

        return h.dtype in (torch.bfloat16, torch.float16) and triton_available()

    def routed_grouped(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """All (token, expert) pairs sorted by expert through two grouped W4A16 GEMMs."""
        from blockspec.quant.triton_w4a16 import grouped_blocks, grouped_w4a16, sort_by_expert

        (wu, su, s2u), (wd, sd, s2d) = self._grouped
        order, offsets = sort_by_expert(ids, len(self.experts))
        tok = order // ids.shape[1]
        x = h[tok]
        blocks = grouped_blocks(offsets, x.shape[0])
        up = grouped_w4a16(x, offsets, wu, su, s2u, blocks=blocks)
        y = grouped_w4a16(relu2(up), offsets, wd, sd, s2d, blocks=blocks)
        out = torch.zeros(h.shape[0], y.shape[1], dtype=torch.float32, device=h.device)
        out.index_add_(0, tok, y.float() * w.reshape(-1)[order][:, None])
        return out.to(h.dtype)

    def routed(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Reference expert loop: tokens grouped by expert, weighted sum in fp32."""
        if self._use_grouped(h):
            return self.routed_grouped(h, ids, w)
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        tok = order // ids.shape[1]
        wt = w.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tok[start:start + n]
                y = self.experts[e](h[rows])
                out.index_add_(0, rows, y.float() * wt[start:start + n, None])
            start += n
        return out.to(h.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.gate(x)
        h = self.fc1_latent_proj(x) if self.latent else x
        y = self.routed(h, ids, w)
        if self.latent:
            y = self.fc2_latent_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
