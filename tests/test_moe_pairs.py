"""The per-pair expert GEMV against its torch reference on fresh random inputs: the Triton
interpreter on CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels.moe_pairs import pair_gemv, pair_gemv_reference

from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")




@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("tokens, topk, experts, n, k, dtype, bias, relu2, per_pair", [
    (1, 6, 16, 100, 200, torch.float32, False, True, False),     # ragged N and K
    (3, 2, 4, 64, 256, torch.bfloat16, True, False, False),
    (2, 3, 8, 130, 96, torch.bfloat16, False, False, True),     # x rows per pair (down proj)
])
def test_pair_gemv_matches_reference(mode, tokens, topk, experts, n, k, dtype, bias, relu2,
                                     per_pair):
    g = torch.Generator().manual_seed(n + k)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(mode)
    rows = tokens * topk if per_pair else tokens
    x = torch.randn(rows, k, generator=g).to(dtype).to(mode)
    w = (torch.randn(experts, n, k, generator=g) / k ** 0.5).to(dtype).to(mode)
    b = torch.randn(experts, n, generator=g).to(dtype).to(mode) if bias else None
    want = pair_gemv_reference(x, ids, w, b, relu2, per_pair)
    got = pair_gemv(x, ids, w, b, relu2=relu2, x_per_pair=per_pair)
    assert got.shape == (tokens * topk, n) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # another tile shape (the GPU picks narrower column tiles when there are few pairs)
    small = pair_gemv(x, ids, w, b, relu2=relu2, x_per_pair=per_pair, block_n=16, block_k=64)
    torch.testing.assert_close(small.float(), want.float(), **tol)
    # each pair used its own expert: routing every pair to expert 0 gives something else
    other = pair_gemv(x, torch.zeros_like(ids), w, b, relu2=relu2, x_per_pair=per_pair)
    assert not torch.allclose(other.float(), want.float(), **tol)


def test_pair_gemv_rejects_mismatched_width():
    with pytest.raises(ValueError, match="pair_gemv"):
        pair_gemv(torch.zeros(1, 8), torch.zeros(1, 2, dtype=torch.long), torch.zeros(4, 3, 9))
