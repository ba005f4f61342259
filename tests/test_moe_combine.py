"""The fused MoE combine against its torch reference on fresh random inputs: the Triton
interpreter on CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels.moe_combine import inverse_order, moe_combine, moe_combine_reference
from blockspec.layers.moe import sort_by_expert

from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")




def test_inverse_order_inverts():
    order = torch.randperm(37)
    inv = inverse_order(order)
    assert torch.equal(order[inv], torch.arange(37))


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("tokens, topk, experts, hidden, dtype, shared, in_pair_order", [
    (1, 6, 16, 100, torch.float32, True, False),
    (5, 2, 4, 2688, torch.bfloat16, True, False),
    (3, 4, 8, 64, torch.float32, False, False),
    (4, 3, 8, 72, torch.bfloat16, True, True),
])
def test_moe_combine_matches_reference(mode, tokens, topk, experts, hidden, dtype, shared,
                                       in_pair_order):
    g = torch.Generator().manual_seed(tokens * 100 + hidden)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    order, _ = sort_by_expert(ids, experts)
    y = torch.randn(tokens * topk, hidden, generator=g).to(dtype).to(mode)
    w = torch.rand(tokens, topk, generator=g).to(mode)
    sh = torch.randn(tokens, hidden, generator=g).to(dtype).to(mode) if shared else None
    order = None if in_pair_order else order.to(mode)
    want = moe_combine_reference(y, order, w, sh, dtype)
    got = moe_combine(y, order, w, sh, dtype)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    # bf16: the routed sum is rounded before the shared add in both, from sums taken in a
    # different order, so results may differ by one ulp of the routed part (|routed| <~ 8)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2 ** -5)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # the weights matter: dropping one expert's share changes the result
    w2 = w.clone()
    w2[:, 0] = 0
    assert not torch.allclose(moe_combine(y, order, w2, sh, dtype).float(), want.float(), **tol)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_combine_sums_shared_parts(mode, dtype):
    """The shared expert in S slices (the pair kernel's extra rows after the routed ones): the
    slices are summed in fp32 and rounded before the add, as one shared row would be."""
    g = torch.Generator().manual_seed(5)
    tokens, topk, parts, hidden = 3, 2, 2, 96
    rows = torch.randn(tokens * (topk + parts), hidden, generator=g).to(dtype).to(mode)
    w = torch.rand(tokens, topk, generator=g).to(mode)
    y, shared = rows[:tokens * topk], rows[tokens * topk:].view(tokens, parts, hidden)
    got = moe_combine(y, None, w, shared, dtype)
    want = moe_combine_reference(y, None, w, shared, dtype)
    whole = moe_combine_reference(y, None, w, shared.float().sum(1).to(dtype), dtype)
    assert torch.equal(want, whole)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2 ** -5)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # the second slice counts
    assert not torch.allclose(moe_combine(y, None, w, shared[:, :1], dtype).float(),
                              want.float(), **tol)
