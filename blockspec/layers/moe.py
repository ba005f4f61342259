"""Nemotron-H feed-forward mixers: the dense relu^2 MLP and the routed MoE.

Routing: sigmoid scores in fp32; ``e_score_correction_bias`` only steers *which* experts are
chosen (group-limited top-k over ``n_group`` groups, each group scored by its best two);
the weights are the un-biased scores, renormalised when ``norm_topk_prob``, times
``routed_scaling_factor``. Experts are non-gated: down(relu(up(x))^2).

The routed experts run without reading the device back (graph-safe). Decode-sized batches
(at most ``PAIR_PATH_MAX_PAIRS`` (token, expert) pairs, on the GPU) run per pair: each pair's
programs read its expert's rows (``kernels/moe_pairs.py``; the W4A16 kernel's pair mode,
``pair_w4a16``, for packed NVFP4 experts), with
no sort and no gather; the pairs of several tokens (a verify) that share an expert read and
decode it once (the dedup kernels). Larger
batches sort the pairs by expert on the device and run grouped GEMMs over stacked expert
weights (``torch._grouped_mm`` for dense weights, the Triton W4A16 kernel for packed ones).
Packed experts' up projections square their relu in the W4A16 kernel's epilogue on both paths.
Either way the weighted sum and the shared expert's add are one kernel
(``kernels/moe_combine.py``) on the GPU.
``routed_reference`` is the plain per-expert loop the fast paths are tested against.
On CUDA the routing after the router GEMM and the sort by expert are fused Triton kernels
(kernels/moe_routing.py); ``route_reference`` and ``sort_by_expert_reference`` are the torch
versions they are tested against.
"""
from __future__ import annotations

import torch
from torch import nn

from blockspec.kernels import moe_routing
from blockspec.kernels.grouped_mm import grouped_mm_ok
from blockspec.kernels.moe_combine import moe_combine, moe_combine_reference
from blockspec.kernels.moe_pairs import DEDUP_MAX_TOKENS, pair_gemv
from blockspec.kernels.relu2 import relu2 as relu2_kernel, relu2_reference
from blockspec.kernels.router_gemv import router_logits_reference, router_partials
from blockspec.kernels.triton_loader import triton_available, use_triton
from blockspec.kernels.w4a16 import (PAIR_DEDUP_MAX_TOKENS, grouped_blocks, grouped_w4a16,
                                     grouped_x_chunk, pair_w4a16, stream_order)
from blockspec.layers.linear import Linear, QuantPlan, build_linear
from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.quant.linear import NVFP4Linear, stack_nvfp4_experts

# the per-pair path's limit: beyond it grouping pairs by expert saves weight reads. Packed
# experts also stop at the dedup kernel's PAIR_DEDUP_MAX_TOKENS: on the quantized Lightning
# preset (top-6) the pair path beat the grouped one at every count up to 16 tokens (96 pairs;
# 116 against 202 us a layer at 16) and lost 1.8-2.7x past it (scripts/bench_moe_paths.py)
PAIR_PATH_MAX_PAIRS = 96


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2: one kernel on the GPU (``kernels/relu2.py``), the torch reference elsewhere."""
    return relu2_kernel(x) if use_triton(x) else relu2_reference(x)


class ReluSquaredMLP(nn.Module):
    def __init__(self, prefix: str, hidden: int, inner: int, bias: bool,
                 quant: QuantPlan | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.up_proj = build_linear(f"{prefix}.up_proj", hidden, inner, bias, quant, dtype)
        self.down_proj = build_linear(f"{prefix}.down_proj", inner, hidden, bias, quant, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(self.up_proj, "forward_relu2", None)
        h = fused(x) if fused is not None else None      # NVFP4 up: relu^2 in its epilogue
        return self.down_proj(relu2(self.up_proj(x)) if h is None else h)


class TopkRouter(nn.Module):
    def __init__(self, cfg: NemotronHConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        # fp32 whatever the model dtype: the router GEMM runs in fp32 (as transformers' does),
        # and a bf16 checkpoint value widens exactly once here instead of on every call
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [T,k], weights [T,k] fp32): on CUDA the router GEMV is one
        kernel (``kernels/router_gemv.py``, x widened in registers, K split over programs)
        and the routing another, which sums the GEMV's partials; elsewhere
        ``router_logits_reference`` and ``route_reference``."""
        w = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        args = (self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                self.norm_topk_prob, self.scale)
        if use_triton(x) and x.dim() == 2 and w.is_contiguous():
            return moe_routing.route(router_partials(x, w), *args)     # partials [S, T, E]
        return route_reference(router_logits_reference(x, w), *args)


def route_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                    topk_group: int, norm_topk_prob: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, k], weights [T, k] fp32); see the module note."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    if n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)
        group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        keep = group_score.topk(topk_group, dim=-1).indices
        gmask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~gmask[:, :, None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale


class MoE(nn.Module):
    def __init__(self, cfg: NemotronHConfig, prefix: str, quant: QuantPlan | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate = TopkRouter(cfg, dtype)
        expert_in = cfg.moe_latent_size or cfg.hidden_size
        # expert parallelism: this rank's whole experts [lo, hi) of the router's E
        self.local = cfg.local_experts
        lo, hi = self.local or (0, cfg.n_routed_experts)
        self.experts = nn.ModuleList(
            ReluSquaredMLP(f"{prefix}.experts.{e}", expert_in, cfg.moe_intermediate_size,
                           cfg.mlp_bias, quant, dtype)
            for e in range(lo, hi))
        self.shared_experts = (
            ReluSquaredMLP(f"{prefix}.shared_experts", cfg.hidden_size,
                           cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias, quant, dtype)
            if cfg.n_shared_experts else None)
        self._grouped = None   # stacked packed experts, set by prepare_grouped()
        self._dense = None     # stacked dense experts (weight [E, N, K], bias [E, N] | None)
        self._shared_parts = 0  # shared-expert slices at the end of the packed stacks
        self.latent = cfg.moe_latent_size is not None
        if self.latent:
            self.fc1_latent_proj = build_linear(f"{prefix}.fc1_latent_proj", cfg.hidden_size,
                                                cfg.moe_latent_size, cfg.mlp_bias, quant, dtype)
            self.fc2_latent_proj = build_linear(f"{prefix}.fc2_latent_proj", cfg.moe_latent_size,
                                                cfg.hidden_size, cfg.mlp_bias, quant, dtype)

    def prepare_grouped(self) -> bool:
        """Stack the routed experts' weights once (the per-expert buffers become views, so the
        weights stay in memory once) for the grouped paths. Call after loading, on the final
        device. Returns False when the experts mix formats (the reference loop then runs)."""
        ups = [e.up_proj for e in self.experts]
        downs = [e.down_proj for e in self.experts]
        if all(isinstance(m, NVFP4Linear) for m in ups + downs):
            slices = self._shared_slices()
            self._grouped = (stack_nvfp4_experts(ups, slices[0]),
                             stack_nvfp4_experts(downs, slices[1]))
            self._shared_parts = len(slices[0])
            if self._shared_parts:      # the shared up projection reads its stacked rows
                up, (w, s, _) = self.shared_experts.up_proj, self._grouped[0]
                up.weight = w[len(ups):].reshape(up.weight.shape)
                up.weight_scale = s[len(ups):].reshape(up.weight_scale.shape)
                up.kernel_layout = True
            return True
        if all(type(m) is Linear for m in ups + downs):
            self._dense = (_stack_dense(ups), _stack_dense(downs))
            return True
        return False

    def _shared_slices(self) -> tuple[list, list]:
        """The shared expert as S pseudo-experts of the routed shape, for the pair path to run
        it in the routed experts' launches (([up slices], [down slices]) of (packed, scales,
        global scale)), or empty lists where it does not fit: both projections NVFP4 without
        bias, the intermediate size S x the routed one, the same input and output sizes. Up
        slices are row blocks, down slices column blocks of the intermediate dimension, so
        down(relu2(up(x))) is the sum of the S slices' outputs. The down slices are copies
        (column blocks are not views): the grouped path still runs the whole module."""
        sh, routed = self.shared_experts, self.experts[0]
        if sh is None or self.latent:
            return [], []
        up, down = sh.up_proj, sh.down_proj
        r_up, r_down = routed.up_proj, routed.down_proj
        inner = r_up.out_features
        if not (isinstance(up, NVFP4Linear) and isinstance(down, NVFP4Linear)
                and up.bias is None and down.bias is None and up.fmt == r_up.fmt
                and down.fmt == r_down.fmt and up.out_features % inner == 0
                and up.in_features == r_up.in_features
                and down.out_features == r_down.out_features and inner % 16 == 0):
            return [], []
        parts = up.out_features // inner
        up_w, down_w = up.checkpoint_weight(), down.checkpoint_weight()
        ups = [(up_w[i * inner:(i + 1) * inner], up.weight_scale[i * inner:(i + 1) * inner],
                up.weight_scale_2) for i in range(parts)]
        half, groups = inner // 2, inner // 16
        downs = [(down_w[:, i * half:(i + 1) * half],
                  down.weight_scale[:, i * groups:(i + 1) * groups], down.weight_scale_2)
                 for i in range(parts)]
        return ups, downs

    def graph_safe(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``routed`` avoids the reference loop (which reads expert counts back to the
        host and so cannot run inside a CUDA graph) for activations of ``dtype`` on ``device``."""
        if self._dense is not None:
            return True
        if self._grouped is None or device.type != "cuda":
            return False
        return dtype in (torch.bfloat16, torch.float16) and triton_available()

    def _use_grouped(self, h: torch.Tensor) -> bool:
        return self._grouped is not None and self.graph_safe(h.dtype, h.device)

    def routed_grouped(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                       shared: torch.Tensor | None) -> torch.Tensor:
        """All (token, expert) pairs sorted by expert through two grouped W4A16 GEMMs."""
        (wu, su, s2u), (wd, sd, s2d) = self._grouped     # offsets skip the shared slices
        order, offsets = sort_by_expert(ids, len(self.experts))
        tok = order // ids.shape[1]
        n, k = wu.shape[1], wu.shape[2] * 2
        chunk = grouped_x_chunk(n, k, ids.numel(), len(self.experts))  # x_perm: in the gather
        x = (stream_order(h.reshape(-1, k), chunk) if chunk else h)[tok]
        blocks = grouped_blocks(offsets, x.shape[0], shape=(n, k))
        up = grouped_w4a16(x, offsets, wu, su, s2u, blocks=blocks, relu2=True, x_ordered=chunk)
        y = grouped_w4a16(up, offsets, wd, sd, s2d, blocks=blocks)
        return combine(y, order, w, shared, h.dtype)

    def routed_pairs(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                     shared: torch.Tensor | None, ride: bool = False) -> torch.Tensor:
        """Decode-sized batches: each (token, expert) pair through its expert's weights, in
        pair order (no sort, no gather); see the module docstring. Several tokens (a
        speculative verify) read each distinct expert once (``dedup``); one token's experts
        are distinct already. ``ride`` (packed experts with ``_shared_parts``): the shared
        expert runs as its slices inside the same two launches, ``shared`` unused."""
        if self._dense is not None:
            (wu, bu), (wd, bd) = self._dense
            dedup = 1 < ids.shape[0] <= DEDUP_MAX_TOKENS
            up = pair_gemv(h, ids, wu, bu, relu2=True, dedup=dedup)
            y = pair_gemv(up, ids, wd, bd, x_per_pair=True, dedup=dedup)
        else:
            (wu, su, s2u), (wd, sd, s2d) = self._grouped
            dedup = 1 < ids.shape[0] <= PAIR_DEDUP_MAX_TOKENS
            parts = self._shared_parts if ride else 0
            # ids come from top-k routing: distinct within each token (not once expert
            # parallelism has sent another rank's pairs to local expert 0)
            kw = dict(dedup=dedup, distinct=self.local is None, shared_parts=parts)
            up = pair_w4a16(h, ids, wu, su, s2u, relu2=True, **kw)
            y = pair_w4a16(up, ids, wd, sd, s2d, x_per_pair=True, **kw)
            if parts:
                n = ids.numel()
                return combine(y[:n], None, w, y[n:].view(ids.shape[0], parts, -1), h.dtype)
        return combine(y, None, w, shared, h.dtype)

    def routed_dense(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                     shared: torch.Tensor | None) -> torch.Tensor:
        """Dense stacked experts: pairs sorted by expert, ``torch._grouped_mm`` over the
        expert offsets where it runs natively (CPU; bf16 on sm90+), else each pair's expert
        weights gathered into one batched matmul. No host read either way."""
        (wu, bu), (wd, bd) = self._dense
        order, offsets = sort_by_expert(ids, len(self.experts))
        tok = order // ids.shape[1]
        expert = ids.reshape(-1)[order]
        x = h[tok]
        if grouped_mm_ok(x, *wu.shape[-2:], *wd.shape[-2:]):
            offs = offsets[1:].to(torch.int32)
            up = torch._grouped_mm(x, wu.transpose(-2, -1), offs=offs)
            if bu is not None:
                up = up + bu[expert]
            y = torch._grouped_mm(relu2(up), wd.transpose(-2, -1), offs=offs)
        else:
            up = torch.bmm(wu[expert], x[:, :, None])[..., 0]
            if bu is not None:
                up = up + bu[expert]
            y = torch.bmm(wd[expert], relu2(up)[:, :, None])[..., 0]
        if bd is not None:
            y = y + bd[expert]
        return combine(y, order, w, shared, h.dtype)

    def routed_reference(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                         shared: torch.Tensor | None = None) -> torch.Tensor:
        """Reference expert loop: tokens grouped by expert, weighted sum in fp32 (reads the
        expert counts back to the host; tests and the mixed-format fallback only)."""
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
        out = out.to(h.dtype)
        return out if shared is None else out + shared

    def _pair_path(self, h: torch.Tensor, ids: torch.Tensor) -> bool:
        return (ids.numel() <= PAIR_PATH_MAX_PAIRS and use_triton(h)
                and (self._dense is not None
                     or (ids.shape[0] <= PAIR_DEDUP_MAX_TOKENS and self._use_grouped(h))))

    def routed(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
               shared: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum in h's dtype, plus ``shared`` when given."""
        if self._pair_path(h, ids):
            return self.routed_pairs(h, ids, w, shared)
        if self._use_grouped(h):
            return self.routed_grouped(h, ids, w, shared)
        if self._dense is not None:
            return self.routed_dense(h, ids, w, shared)
        return self.routed_reference(h, ids, w, shared)

    def local_pairs(self, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: the router's global ids as this rank's local ones, pairs naming
        another rank's expert at weight 0 (they run through local expert 0 and add nothing;
        device ops only, so the step stays graph-safe)."""
        lo, hi = self.local
        mine = (ids >= lo) & (ids < hi)
        return torch.where(mine, ids - lo, 0), torch.where(mine, w, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.gate(x)
        if self.local is not None:
            ids, w = self.local_pairs(ids, w)
        if self.latent:
            y = self.fc2_latent_proj(self.routed(self.fc1_latent_proj(x), ids, w))
            return y if self.shared_experts is None else y + self.shared_experts(x)
        if self._shared_parts and self._pair_path(x, ids):
            return self.routed_pairs(x, ids, w, None, ride=True)   # shared expert rides along
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        return self.routed(x, ids, w, shared)


def combine(y: torch.Tensor, order: torch.Tensor | None, w: torch.Tensor,
            shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of each token's expert rows (+ the shared expert): one kernel on the GPU."""
    if use_triton(y):
        return moe_combine(y, order, w, shared, dtype)
    return moe_combine_reference(y, order, w, shared, dtype)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert: (order into ``topk_ids.flatten()``, offsets [E+1]),
    each expert's pairs in flat order. One fused kernel on CUDA for small pair counts."""
    if use_triton(topk_ids) and topk_ids.numel() <= moe_routing.SORT_MAX_PAIRS:
        return moe_routing.sort_by_expert(topk_ids, num_experts)
    return sort_by_expert_reference(topk_ids, num_experts)


def sort_by_expert_reference(topk_ids: torch.Tensor,
                             num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sort_by_expert`` in torch. Counts come from a scatter-add (``bincount`` would read its
    maximum back to the host)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets


def _stack_dense(modules: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[E, N, K] weights (and [E, N] biases) with each expert's parameters re-pointed at views."""
    weight = torch.stack([m.weight.data for m in modules])
    bias = torch.stack([m.bias.data for m in modules]) if modules[0].bias is not None else None
    for e, m in enumerate(modules):
        m.weight.data = weight[e]
        if bias is not None:
            m.bias.data = bias[e]
    return weight, bias
