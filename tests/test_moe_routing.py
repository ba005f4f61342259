"""The fused MoE routing kernels (kernels/moe_routing.py) against the torch references in
layers/moe.py on fresh random inputs: the Triton interpreter on CPU, compiled on a GPU
(``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.layers.moe import route_reference, sort_by_expert_reference

from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")

# (tokens, top_k, experts) of the sort; the interpreter runs the small ones only
SORTS = [(1, 6, 128), (16, 6, 128), (37, 6, 128), (50, 2, 40), (3, 1, 1000), (5, 16, 512)]
GPU_SORTS = [(682, 6, 128), (256, 16, 512), (1000, 4, 64)]



@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("splits, n_group", [(3, 1), (2, 8)])
def test_route_sums_the_router_partials(mode, splits, n_group):
    """The router GEMV's K-split partials [S, T, E] route exactly as their sum in index order
    (the kernel adds them as it reads them): ids and weights bit-equal."""
    from blockspec.kernels.moe_routing import route
    from blockspec.kernels.router_gemv import sum_partials

    g = torch.Generator().manual_seed(splits)
    parts = torch.randn(splits, 5, 64, generator=g).to(mode)
    bias = (0.5 * torch.randn(64, generator=g)).to(mode)
    args = (bias, 6, n_group, min(n_group, 4), True, 2.5)
    ids, w = route(parts, *args)
    want_ids, want_w = route(sum_partials(parts), *args)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    ref_ids, _ = route_reference(sum_partials(parts), *args)
    assert torch.equal(ids, ref_ids)
    with pytest.raises(ValueError, match=r"logits must be \[T, E\] or \[S, T, E\]"):
        route(parts[None], *args)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("tokens, experts, top_k, n_group, topk_group, norm, scale", [
    (1, 128, 6, 1, 1, True, 2.5),        # Lightning
    (37, 128, 6, 1, 1, False, 1.0),
    (9, 64, 8, 8, 4, True, 2.5),         # DeepSeek-style groups
    (5, 96, 4, 3, 2, True, 1.0),         # groups and group size not powers of two
    (6, 40, 3, 4, 1, False, 0.5),        # one group kept: all of k from it
    (3, 16, 2, 16, 3, True, 1.0),        # groups of one expert (the limit cannot bind)
    (4, 512, 16, 1, 1, True, 1.0),       # the largest supported
])
def test_route_kernel_matches_reference(mode, tokens, experts, top_k, n_group, topk_group, norm,
                                        scale):
    from blockspec.kernels.moe_routing import route

    g = torch.Generator().manual_seed(tokens * experts + top_k)
    logits = (2 * torch.randn(tokens, experts, generator=g)).to(mode)
    bias = (0.5 * torch.randn(experts, generator=g)).to(mode)
    args = (bias, top_k, n_group, topk_group, norm, scale)
    ids, w = route(logits, *args)
    want_ids, want_w = route_reference(logits, *args)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)
    if experts > n_group > 1:   # the group limit binds here: plain top-k would choose otherwise
        plain = (torch.sigmoid(logits) + bias).topk(top_k, dim=-1).indices
        assert not torch.equal(ids, plain)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.full((tokens,), scale, device=mode))


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_route_kernel_ties_go_to_the_smaller_expert(mode):
    """Documented tie rule: equal choice values are taken smallest expert index first."""
    from blockspec.kernels.moe_routing import route

    logits = torch.zeros(2, 32, device=mode)
    logits[1, 20:] = 1.0                        # row 1: experts 20..31 tie at the top
    bias = torch.zeros(32, device=mode)
    ids, w = route(logits, bias, 4, 1, 1, True, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3], [20, 21, 22, 23]]
    torch.testing.assert_close(w, torch.full((2, 4), 0.25, device=mode))
    ids, _ = route(logits, bias, 3, 4, 2, True, 1.0)       # tied groups: 0 and 1 kept
    assert ids.tolist()[0] == [0, 1, 2]


def test_route_refuses_configurations_that_do_not_fit():
    from blockspec.kernels.moe_routing import route

    logits, bias = torch.zeros(1, 12), torch.zeros(12)
    for k, n_group, topk_group in [(13, 1, 1), (2, 5, 1), (2, 4, 5)]:
        with pytest.raises(ValueError, match="do not fit"):
            route(logits, bias, k, n_group, topk_group, True, 1.0)


@pytest.mark.parametrize("mode, tokens, top_k, experts", [
    ("cpu", *case) for case in SORTS] + [pytest.param("cuda", *case, marks=GPU)
                                         for case in SORTS + GPU_SORTS], indirect=["mode"])
def test_sort_by_expert_kernel_matches_reference(mode, tokens, top_k, experts):
    """Exactly the stable argsort and offsets, with many pairs per expert (stability matters) and,
    for the wide case, most experts empty."""
    from blockspec.kernels.moe_routing import sort_by_expert

    g = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randint(0, min(experts, 24), (tokens, top_k), generator=g)
    ids = (ids * (experts // min(experts, 24))).to(mode)
    order, offsets = sort_by_expert(ids, experts)
    want_order, want_offsets = sort_by_expert_reference(ids, experts)
    assert torch.equal(order, want_order)
    assert torch.equal(offsets, want_offsets)
    assert offsets[-1].item() == tokens * top_k


def test_sort_by_expert_kernel_refuses_too_many_pairs():
    from blockspec.kernels.moe_routing import SORT_MAX_PAIRS, sort_by_expert

    with pytest.raises(ValueError, match="one-program limit"):
        sort_by_expert(torch.zeros(SORT_MAX_PAIRS + 1, dtype=torch.int64), 4)


def _refuse(*_args):
    raise AssertionError("the torch reference ran where the kernel should have")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_and_sort_take_the_kernels_on_cuda_inside_a_graph(monkeypatch):
    """TopkRouter.forward and sort_by_expert dispatch to the kernels on CUDA (no grad), match the
    references, and replay inside a CUDA graph on new inputs; past the one-program limit
    sort_by_expert answers through the reference."""
    from blockspec.kernels import moe_routing
    from blockspec.layers import moe
    from blockspec.configs.nemotron_h import NemotronHConfig

    cfg = NemotronHConfig.from_dict({
        "model_type": "nemotron_h", "hybrid_override_pattern": "E", "vocab_size": 16,
        "hidden_size": 64, "n_routed_experts": 128, "num_experts_per_tok": 6,
        "routed_scaling_factor": 2.5, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16})
    dev = torch.device("cuda")
    router = moe.TopkRouter(cfg, torch.float32).to(dev)
    g = torch.Generator().manual_seed(3)
    router.weight.data = torch.randn(128, 64, generator=g).to(dev)
    router.e_score_correction_bias.copy_(0.3 * torch.randn(128, generator=g))
    args = (router.e_score_correction_bias, 6, 1, 1, True, 2.5)
    x = torch.randn(8, 64, generator=g).to(dev)
    first_ids, first_w = route_reference(x @ router.weight.T, *args)
    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(moe, "route_reference", _refuse)
        patch.setattr(moe, "sort_by_expert_reference", _refuse)
        ids, w = router(x)
        order, offsets = moe.sort_by_expert(ids, 128)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_ids, g_w = router(x)
            g_order, g_offsets = moe.sort_by_expert(g_ids, 128)
        x.copy_(torch.randn(8, 64, generator=g).to(dev))
        graph.replay()
    with torch.no_grad():
        big = torch.randint(0, 128, (moe_routing.SORT_MAX_PAIRS // 6 + 1, 6), device=dev)
        big_order, big_offsets = moe.sort_by_expert(big, 128)
    assert torch.equal(ids, first_ids)
    torch.testing.assert_close(w, first_w, rtol=1e-6, atol=0)
    assert torch.equal((order, offsets)[0], sort_by_expert_reference(ids, 128)[0])
    want_ids, want_w = route_reference(x @ router.weight.T, *args)
    assert torch.equal(g_ids, want_ids) and not torch.equal(g_ids, ids)
    torch.testing.assert_close(g_w, want_w, rtol=1e-6, atol=0)
    want_order, want_offsets = sort_by_expert_reference(want_ids, 128)
    assert torch.equal(g_order, want_order) and torch.equal(g_offsets, want_offsets)
    ref_order, ref_offsets = sort_by_expert_reference(big, 128)
    assert torch.equal(big_order, ref_order) and torch.equal(big_offsets, ref_offsets)
