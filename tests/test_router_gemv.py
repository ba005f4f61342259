"""The one-launch MoE router logits against ``F.linear(x.float(), w)`` on fresh random inputs:
the Triton interpreter on CPU, compiled on a GPU (``-m gpu``). The kernel sums in fp32 in
another order than torch, so results agree to fp32 rounding relative to the magnitudes summed
(sum_k |x_k w_k|), not bit for bit; run to run they are identical."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels.router_gemv import (GEMM_MIN_TOKENS, _blocks, _splits,
                                           router_logits_reference, router_partials,
                                           sum_partials)
from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")


def _inputs(t, e, h, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    # activations with a spread of magnitudes (as after an RMSNorm with learned scales)
    x = (torch.randn(t, h, generator=g) * torch.logspace(-1, 1, h)).to(dtype).to(device)
    w = (torch.randn(e, h, generator=g) * 0.05).to(device)
    return x, w


def router_logits(x, w, **kw):
    """The logits the routing kernel sees: the GEMV's K-split partials added in index order."""
    return sum_partials(router_partials(x, w, **kw))


def _assert_close(got, x, w, rel=1e-5):
    want = router_logits_reference(x, w)
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = x.float().abs() @ w.abs().T           # sum_k |x_k w_k|: what the rounding scales with
    err = (got - want).abs()
    assert (err <= rel * scale + 1e-30).all(), f"max err / scale {(err / scale).max().item():.3g}"


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("experts, hidden", [(8, 64), (8, 112), (128, 112)])
@pytest.mark.parametrize("tokens", [1, 4, 6, 17, 64])
def test_matches_reference(mode, tokens, experts, hidden, dtype):
    x, w = _inputs(tokens, experts, hidden, dtype, mode, seed=tokens * 1000 + experts + hidden)
    got = router_logits(x, w)
    _assert_close(got, x, w)
    assert torch.equal(router_logits(x, w), got)     # deterministic


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("tokens, experts, blocks", [
    (1, 12, (1, 4, 32)),       # experts not a multiple of BLOCK_E, 4 K chunks with a tail
    (6, 8, (8, 2, 16)),        # tokens not a multiple of BLOCK_T, 7 K chunks
    (17, 128, (16, 8, 64)),    # a second, nearly empty token block
    (64, 128, (16, 4, 32)),
])
def test_tiles_and_k_loop(mode, tokens, experts, blocks):
    """Forced small tiles: several K chunks (H = 112 leaves a partial last chunk) and partial
    expert and token blocks, which the default tiles on small CPU shapes do not reach."""
    x, w = _inputs(tokens, experts, 112, torch.bfloat16, mode, seed=tokens + experts)
    _assert_close(router_logits(x, w, blocks=blocks), x, w)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_float_inputs(mode, dtype):
    x, w = _inputs(6, 8, 112, dtype, mode, seed=5)
    _assert_close(router_logits(x, w), x, w)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_real_hidden_size_on_few_experts(mode):
    x, w = _inputs(6, 8, 2688, torch.bfloat16, mode, seed=7)
    _assert_close(router_logits(x, w), x, w)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_strided_and_offset_input(mode):
    x, w = _inputs(12, 8, 112, torch.float32, mode, seed=3)
    rows = x[1::2]                                    # row stride 2H, storage offset H
    _assert_close(router_logits(rows, w), rows, w)
    cols = torch.randn(112, 5, generator=torch.Generator().manual_seed(4)).to(mode).T
    _assert_close(router_logits(cols, w), cols, w)   # column stride != 1: copied first


def test_empty():
    w = torch.randn(8, 64)
    assert router_logits(torch.randn(0, 64), w).shape == (0, 8)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("tokens, blocks, splits", [
    (1, (1, 1, 32), 3),        # 4 K chunks (H = 112) over 3 splits: 2, 2 and none left
    (6, (8, 2, 16), 4),        # 7 chunks over 4 splits, partial expert and token blocks
    (4, (4, 4, 16), 7),        # one chunk per split
    (3, (4, 8, 32), 9),        # more splits than chunks: capped at 4
])
def test_k_splits(mode, tokens, blocks, splits):
    """Each split's partial is the product over its own columns, and the partials add up to
    the logits in index order (``sum_partials``, what the routing kernel does)."""
    x, w = _inputs(tokens, 12, 112, torch.bfloat16, mode, seed=tokens * 7 + splits)
    parts = router_partials(x, w, blocks=blocks, splits=splits)
    chunk = -(-(-(-112 // blocks[2])) // parts.shape[0]) * blocks[2]
    assert parts.shape == (min(splits, -(-112 // blocks[2])), tokens, 12)
    for s in range(parts.shape[0]):
        cols = slice(s * chunk, (s + 1) * chunk)
        _assert_close(parts[s], x[:, cols], w[:, cols].contiguous())
    _assert_close(sum_partials(parts), x, w)
    assert torch.equal(router_partials(x, w, blocks=blocks, splits=splits), parts)  # deterministic


def test_default_splits():
    """Lightning on an H200: decode and verify sizes split K in 3 (one chunk per program,
    384 programs); batched verifies that already fill the GPU do not split."""
    assert _splits(128, 3, 132) == 3
    assert _splits(128, 6, 132) == 3
    assert _splits(256, 11, 132) == 1
    assert _splits(1024, 11, 132) == 1
    assert _splits(8, 2, 132) == 2           # never more splits than chunks
    x, w = _inputs(1, 8, 64, torch.float32, "cpu", seed=1)
    assert router_partials(torch.zeros(0, 64), w).shape == (1, 0, 8)


def test_prefill_sizes_take_one_gemm():
    """From GEMM_MIN_TOKENS tokens on the logits are one fp32 GEMM (one split, bit-equal to
    the reference); just below it the GEMV kernel's K splits still run."""
    x, w = _inputs(GEMM_MIN_TOKENS, 8, 64, torch.bfloat16, "cpu", seed=3)
    parts = router_partials(x, w)
    assert parts.shape == (1, GEMM_MIN_TOKENS, 8)
    assert torch.equal(parts[0], router_logits_reference(x, w))


def test_default_tiles_spread_the_weight():
    """On an H200 (132 SMs) decode runs one expert per program; bigger T groups experts and
    tokens but keeps at least one program per SM; a verify's 6 tokens take 3 K chunks."""
    assert _blocks(1, 128, 2688, 132) == (1, 1, 1024)
    assert _blocks(6, 128, 2688, 132) == (8, 1, 1024)
    for t in (1, 6, 24, 64):
        bt, be, bk = _blocks(t, 128, 2688, 132)
        assert bt * be * bk <= 8192 or bk == 32
        assert -(-128 // be) * -(-t // bt) >= 128
        assert bt <= 16 and be <= 8 and bk <= 1024


@pytest.mark.parametrize("x_shape, x_dtype, w_shape, w_dtype, w_transposed, match", [
    ((2, 64), torch.bfloat16, (64,), torch.float32, False, "weight must be a 2-D"),
    ((2, 64), torch.bfloat16, (8, 64), torch.bfloat16, False, "weight must be float32"),
    ((2, 64), torch.bfloat16, (64, 8), torch.float32, True, "weight must be contiguous"),
    ((1, 2, 64), torch.bfloat16, (8, 64), torch.float32, False, "x must be a 2-D"),
    ((2, 96), torch.bfloat16, (8, 64), torch.float32, False, r"x must be \[T, H\] with H = "),
    ((2, 64), torch.int32, (8, 64), torch.float32, False, "x must be one of"),
])
def test_bad_input_names_the_tensor(x_shape, x_dtype, w_shape, w_dtype, w_transposed, match):
    x = torch.zeros(x_shape, dtype=x_dtype)
    w = torch.zeros(w_shape, dtype=w_dtype)
    if w_transposed:
        w = w.T
    with pytest.raises(ValueError, match=match):
        router_logits(x, w)


def test_bad_blocks():
    with pytest.raises(ValueError, match="blocks must be powers of two"):
        router_logits(torch.zeros(2, 64), torch.zeros(8, 64), blocks=(2, 3, 32))
    with pytest.raises(ValueError, match="splits must be >= 1"):
        router_partials(torch.zeros(2, 64), torch.zeros(8, 64), splits=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 6, 24])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_real_shape(tokens, dtype):
    x, w = _inputs(tokens, 128, 2688, dtype, torch.device("cuda"), seed=tokens)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False    # the reference in full fp32
    try:
        got = router_logits(x, w)
        _assert_close(got, x, w)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert torch.equal(router_logits(x, w), got)
