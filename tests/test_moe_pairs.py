"""The per-pair expert GEMV, plain and deduplicating, against its torch reference on fresh
random inputs, and the MoE layer's per-pair path over dense experts against its reference
loop: the Triton interpreter on CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels import moe_pairs
from blockspec.kernels.moe_pairs import pair_gemv, pair_gemv_reference
from blockspec.kernels.triton_loader import load_kernels, next_pow2

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


def _routing(tokens: int, topk: int, experts: int, sharing: str,
             g: torch.Generator) -> torch.Tensor:
    """``ids [tokens, topk]``, each token's experts distinct. sharing: "random" (each token
    its own draw: few experts force shared ones), "none" (no expert twice in the batch),
    "same" (every token the same experts, in its own order)."""
    if sharing == "none":
        return torch.randperm(experts, generator=g)[:tokens * topk].view(tokens, topk)
    if sharing == "same":
        pick = torch.randperm(experts, generator=g)[:topk]
        return torch.stack([pick[torch.randperm(topk, generator=g)] for _ in range(tokens)])
    return torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])


def _inputs(mode: torch.device, tokens: int, topk: int, experts: int, n: int, k: int,
            dtype: torch.dtype, bias: bool, per_pair: bool, sharing: str,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Routing, x, stacked weights and (maybe) biases, built on the CPU, moved to ``mode``."""
    g = torch.Generator().manual_seed(seed)
    ids = _routing(tokens, topk, experts, sharing, g).to(mode)
    x = torch.randn(tokens * topk if per_pair else tokens, k, generator=g).to(dtype).to(mode)
    w = (torch.randn(experts, n, k, generator=g) / k ** 0.5).to(dtype).to(mode)
    b = torch.randn(experts, n, generator=g).to(dtype).to(mode) if bias else None
    return ids, x, w, b


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("tokens, topk, experts, n, k, dtype, bias, relu2, per_pair, sharing", [
    # N = 32 j + 4, 32 j + 2: a ragged last column tile (few tiles: the interpreter takes tens
    # of ms a program)
    (4, 6, 8, 36, 200, torch.float32, True, True, False, "random"),     # ragged N and K
    (4, 6, 8, 66, 96, torch.bfloat16, False, False, True, "random"),    # down projection
    (6, 6, 128, 64, 256, torch.bfloat16, True, True, False, "random"),  # a verify's shape
    (5, 2, 16, 48, 80, torch.float32, False, False, True, "same"),      # every token shares
    (3, 4, 64, 72, 64, torch.float16, True, False, False, "none"),      # nothing to share
    (2, 3, 8, 40, 144, torch.float32, False, True, True, "none"),
    (1, 6, 16, 100, 200, torch.bfloat16, True, True, False, "random"),  # a single token
    (17, 2, 4, 32, 32, torch.float32, True, False, False, "random"),    # tokens > 16 rows
])
def test_pair_gemv_dedup_matches_reference(mode, tokens, topk, experts, n, k, dtype, bias,
                                           relu2, per_pair, sharing):
    ids, x, w, b = _inputs(mode, tokens, topk, experts, n, k, dtype, bias, per_pair, sharing,
                           seed=n + k + tokens)
    if sharing == "random" and experts < tokens * topk:
        assert ids.unique().numel() < ids.numel()          # the case does share experts
    want = pair_gemv_reference(x, ids, w, b, relu2, per_pair)
    # every row written by some program: start from NaN, not from what the allocator had
    out = torch.full((tokens * topk, n), float("nan"), dtype=dtype, device=mode)
    got = pair_gemv(x, ids, w, b, relu2=relu2, x_per_pair=per_pair, dedup=True, out=out)
    assert got is out
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
    torch.testing.assert_close(
        pair_gemv(x, ids, w, b, relu2=relu2, x_per_pair=per_pair, dedup=True, block_n=32,
                  block_k=64).float(), want.float(), **_tol(dtype))
    # each pair used its own expert: routing every pair to expert 0 gives something else (the
    # reference computes that: the kernel under the interpreter takes seconds a launch)
    other = pair_gemv_reference(x, torch.zeros_like(ids), w, b, relu2, per_pair)
    assert not torch.allclose(other.float(), want.float(), **_tol(dtype))


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_pair_gemv_dedup_handles_an_expert_twice_in_one_token(mode):
    """Top-k routing never repeats an expert within a token, but the reference allows it:
    such pairs get their own leader, so every row is still computed."""
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([[1, 1, 2], [2, 1, 1], [0, 0, 0]], device=mode)
    x = torch.randn(3, 40, generator=g).to(mode)
    w = torch.randn(3, 24, 40, generator=g).to(mode)
    out = torch.full((9, 24), float("nan"), device=mode)
    got = pair_gemv(x, ids, w, dedup=True, out=out)
    torch.testing.assert_close(got, pair_gemv_reference(x, ids, w, None, False, False),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_pair_gemv_dedup_leader_writes_all_its_experts_rows(mode):
    """Launched for pair 0 alone, the kernel writes the rows of every pair routed to pair
    0's expert and no other row: the rest of its pairs' programs have nothing left to do."""
    tokens, topk, experts, n, k = 5, 3, 6, 40, 48
    ids, x, w, _ = _inputs(mode, tokens, topk, experts, n, k, torch.float32, False, False,
                           "random", seed=9)
    ids[2, 1] = ids[0, 0]                  # pair 0's expert in at least two tokens
    if ids[2, 0] == ids[0, 0] or ids[2, 2] == ids[0, 0]:
        ids[2, 0], ids[2, 2] = (ids[0, 0] + 1) % experts, (ids[0, 0] + 2) % experts
    want = pair_gemv_reference(x, ids, w, None, False, False)
    out = torch.full((tokens * topk, n), float("nan"), device=mode)
    kernel = load_kernels(moe_pairs._KERNELS)._pair_gemv_dedup_kernel
    kernel[(1, -(-n // 16))](
        x, ids.reshape(-1), w, w, out, tokens, n, k, x.stride(0), w.stride(0), w.stride(1),
        out.stride(0), TOPK=topk, X_PER_PAIR=False, HAS_BIAS=False, RELU2=False, DOT_F32=True,
        T_BLOCK=next_pow2(tokens, 16), BLOCK_N=16, BLOCK_K=32, K_ITERS=-(-k // 32))
    shared = (ids.reshape(-1) == ids[0, 0]).cpu()
    assert shared.sum() >= 2
    written = ~out.isnan().any(1).cpu()
    assert torch.equal(written, shared)
    torch.testing.assert_close(out[shared.to(mode)], want[shared.to(mode)], rtol=1e-5, atol=1e-5)


def test_pair_gemv_dedup_rejects_what_it_cannot_tile():
    x, w = torch.zeros(2, 32), torch.zeros(4, 16, 32)
    with pytest.raises(ValueError, match="block_n, block_k >= 16"):
        pair_gemv(x, torch.zeros(2, 2, dtype=torch.long), w, dedup=True, block_n=8)
    many = moe_pairs.DEDUP_MAX_TOKENS + 1
    with pytest.raises(ValueError, match="at most"):
        pair_gemv(torch.zeros(many, 32), torch.zeros(many, 1, dtype=torch.long), w, dedup=True)
    with pytest.raises(ValueError, match="out"):
        pair_gemv(x, torch.zeros(2, 2, dtype=torch.long), w, dedup=True,
                  out=torch.empty(4, 15))


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 6])
def test_moe_pair_path_dedups_several_tokens(mode, dtype, tokens, monkeypatch):
    """The MoE layer's per-pair path over dense experts (the tiny preset: 4 experts, top-2,
    so six tokens share experts) against the reference expert loop; the dedup kernel runs
    exactly when there are several tokens."""
    from blockspec.bench.presets import build_target
    from blockspec.layers import moe as moe_module

    model = build_target("tiny", mode, dtype)
    moe = next(m for m in model.modules() if isinstance(m, moe_module.MoE))
    assert moe._dense is not None
    seen = []

    def spy(*args, **kwargs) -> torch.Tensor:
        seen.append(kwargs.get("dedup", False))
        return pair_gemv(*args, **kwargs)

    monkeypatch.setattr(moe_module, "pair_gemv", spy)
    g = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        h = torch.randn(tokens, moe.gate.weight.shape[1], generator=g).to(dtype).to(mode)
        ids, w = moe.gate(h)
        shared = moe.shared_experts(h) if moe.shared_experts is not None else None
        want = moe.routed_reference(h, ids, w, shared)
        got = moe.routed_pairs(h, ids, w, shared)
        moved = moe.routed_pairs(h, (ids + 1) % len(moe.experts), w, shared)
    assert seen and all(d == (tokens > 1) for d in seen)
    if tokens > 1:
        assert ids.unique().numel() < ids.numel()
    # relative to the output's scale: the tiny model's outputs are ~1e-2
    scale = want.float().abs().max()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max() <= tol * scale
    assert (moved.float() - want.float()).abs().max() > 10 * tol * scale
