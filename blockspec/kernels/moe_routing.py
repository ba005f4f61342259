"""Fused MoE routing for the GPU. After the router GEMM, the torch references (``route_reference``
and ``sort_by_expert_reference`` in layers/moe.py) are a chain of about twenty small kernels per
MoE layer (sigmoid, bias, group and expert top-k, gather, renormalise; argsort, scatter-add,
cumsum), which at small batches costs more in launches than in work. Here each is one launch:
``route`` (one program per token) and ``sort_by_expert`` (one program for up to
``SORT_MAX_PAIRS`` pairs; more go through the reference).

Ties: ``route`` picks, among equal values, the smaller expert (or group) index, and lists the
chosen experts by falling choice value; ``torch.topk`` leaves the order of ties unspecified, so
the two agree exactly when the values are distinct. The same rule fills k past the experts of
the kept groups (k > topk_group * group size) with the lowest masked ones. NaN logits have no
defined order here (``torch.topk`` ranks NaN highest). ``sort_by_expert`` is a stable counting
sort and equals the stable argsort always."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_moe_routing_kernels.py")
# The sort is one program walking the pairs in chunks, so its time grows with the pair count
# while the reference's stays near flat: past this count the reference runs. Both numbers are
# for scripts/bench_moe_routing.py to tune on the GPU.
SORT_MAX_PAIRS = 4096
_SORT_CHUNK = 64        # pairs placed per step of the sort (a [chunk, chunk] comparison)


def _warps(n: int) -> dict:
    return {} if interpreting() else {"num_warps": n}


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
          norm_topk_prob: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (fp32) -> (expert ids [T, k] int64, weights [T, k] fp32), as
    ``route_reference``: sigmoid scores, ``bias`` steering the group-limited top-k, weights the
    un-biased scores (renormalised when ``norm_topk_prob``) times ``scale``. ``logits`` may
    also be the router GEMV's partial sums [S, T, E] (``router_gemv.router_partials``): the
    kernel adds them in index order as it reads them, which is ``route`` of
    ``router_gemv.sum_partials(logits)`` exactly."""
    if logits.dim() == 2:
        logits = logits[None]
    if logits.dim() != 3:
        raise ValueError(f"route: logits must be [T, E] or [S, T, E], got {tuple(logits.shape)}")
    splits, tokens, experts = logits.shape
    n_group = max(1, n_group)
    if experts % n_group or top_k > experts or (n_group > 1 and not 0 < topk_group <= n_group):
        raise ValueError(f"route: {experts} experts, top_k={top_k}, n_group={n_group}, "
                         f"topk_group={topk_group} do not fit together")
    logits = logits.float().contiguous()
    bias = bias.float().contiguous()
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    if tokens == 0:
        return ids, w
    group = experts // n_group
    block_g, block_s = next_pow2(n_group), next_pow2(group)
    load_kernels(_KERNELS)._route_kernel[(tokens,)](
        logits, bias, ids, w, logits.stride(1), logits.stride(0), float(scale),
        K=top_k, N_GROUP=n_group, GROUP=group, TOPK_GROUP=topk_group, GROUP_TOP=min(2, group),
        NORM=bool(norm_topk_prob), SPLITS=splits, BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=next_pow2(top_k),
        **_warps(max(1, min(4, block_g * block_s // 256))))
    return ids, w


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int,
                   chunk: int = _SORT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(order into ``topk_ids.flatten()``, offsets [E+1]) for at most ``SORT_MAX_PAIRS`` pairs:
    pairs grouped by expert, each expert's pairs in their flat order (a stable sort). ``chunk``
    (a power of two) is the pairs placed per step, for tuning."""
    flat = topk_ids.reshape(-1).contiguous()
    pairs = flat.numel()
    if pairs > SORT_MAX_PAIRS:
        raise ValueError(f"sort_by_expert: {pairs} pairs exceed the one-program limit "
                         f"{SORT_MAX_PAIRS}")
    order = torch.empty(pairs, dtype=torch.int64, device=flat.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=flat.device)
    load_kernels(_KERNELS)._sort_by_expert_kernel[(1,)](
        flat, order, offsets, pairs, E=num_experts, BLOCK_E=next_pow2(num_experts),
        CHUNK=min(next_pow2(pairs), chunk), **_warps(4))
    return order, offsets
