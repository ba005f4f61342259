"""Triton W4A16 kernels against the pure-torch reference.

CPU: runs through the Triton interpreter (TRITON_INTERPRET=1) when triton is importable.
GPU (``-m gpu``): compiled kernels on Lightning shapes, bf16, relative error <= 1e-2.
"""
import pytest
import torch

from blockspec.quant import triton_w4a16 as tw
from blockspec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

needs_triton = pytest.mark.skipif(not tw.triton_available(), reason="triton not importable")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _weights(n, k, seed, scale=0.05, device="cpu", experts=None):
    g = torch.Generator().manual_seed(seed)
    if experts is None:
        w = (torch.randn(n, k, generator=g) * scale).bfloat16()
        p, s, s2 = quantize_nvfp4(w)
        return p.to(device), s.to(device), s2.to(device)
    ps, ss, s2s = [], [], []
    for e in range(experts):
        w = (torch.randn(n, k, generator=g) * scale * (1 + e % 3)).bfloat16()
        p, s, s2 = quantize_nvfp4(w)
        ps.append(p), ss.append(s), s2s.append(s2)
    return (torch.stack(ps).to(device), torch.stack(ss).to(device),
            torch.stack(s2s).to(device))


def test_expert_blocks_cover_rows_without_straddling():
    offsets = torch.tensor([0, 3, 3, 20, 21])
    ex, r0, r1, nb = tw.expert_blocks(offsets, 21, 8)
    covered = []
    for e, a, b in zip(ex.tolist(), r0.tolist(), r1.tolist()):
        if a == b:
            continue
        assert offsets[e] <= a < b <= offsets[e + 1] and b - a <= 8
        covered.extend(range(a, b))
    assert sorted(covered) == list(range(21))
    assert nb == ex.numel()


def test_sort_by_expert():
    topk = torch.tensor([[2, 0], [2, 3], [1, 2]])
    order, offsets = tw.sort_by_expert(topk, 5)
    assert offsets.tolist() == [0, 1, 2, 5, 6, 6]
    assert topk.reshape(-1)[order].tolist() == [0, 1, 2, 2, 2, 3]


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@needs_triton
@pytest.mark.parametrize("m, n, k, split_k, block_k", [
    (1, 48, 64, None, 64), (5, 40, 96, 2, 64), (20, 70, 160, 3, 32), (33, 24, 32, 1, 32),
])
def test_dense_kernel_interpreter(interpreter, m, n, k, split_k, block_k):
    p, s, s2 = _weights(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    y = tw.w4a16_linear(x, p, s, s2, split_k=split_k, block_k=block_k, block_n=32)
    ref = tw.w4a16_linear_reference(x, p, s, s2)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, ref) <= 1e-2
    # the bf16 weight tile is the exact dequantized weight: only summation order differs
    exact = x.float() @ dequantize_nvfp4(p, s, s2, torch.bfloat16).float().T
    assert _rel(y, exact) <= 4e-3


@needs_triton
def test_dense_kernel_bias_and_leading_dims(interpreter):
    p, s, s2 = _weights(32, 64, seed=3)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    bias = torch.randn(32).bfloat16()
    y = tw.w4a16_linear(x, p, s, s2, bias, block_k=64, block_n=32)
    ref = tw.w4a16_linear_reference(x, p, s, s2, bias)
    assert y.shape == (2, 3, 32) and _rel(y, ref) <= 1e-2


@needs_triton
def test_grouped_kernel_interpreter(interpreter):
    w, s, s2 = _weights(40, 64, seed=11, experts=5)
    counts = [3, 0, 17, 1, 0]
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
    x = torch.randn(sum(counts), 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    for split in (1, 2):
        y = tw.grouped_w4a16(x, offsets, w, s, s2, block_k=32, block_n=16, split_k=split)
        ref = tw.grouped_w4a16_reference(x, offsets, w, s, s2)
        assert _rel(y, ref) <= 1e-2
        for e in (0, 2, 3):  # each expert's rows really used its own weights
            a, b = offsets[e].item(), offsets[e + 1].item()
            assert _rel(y[a:b], tw.w4a16_linear_reference(x[a:b], w[e], s[e], s2[e])) <= 1e-2


def test_kernel_input_checks():
    p, s, s2 = _weights(16, 32, seed=1)
    with pytest.raises(ValueError, match="K=48"):
        tw.w4a16_linear(torch.zeros(1, 48), p, s, s2)


# ---------------------------------------------------------------- GPU (run on the H200)
LIGHTNING_SHAPES = [(1856, 2688), (2688, 1856), (3712, 2688), (131072, 2688)]


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("n, k", LIGHTNING_SHAPES)
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_dense_kernel_gpu(n, k, m):
    p, s, s2 = _weights(n, k, seed=n + m, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = tw.w4a16_linear(x, p, s, s2)
    ref = tw.w4a16_linear_reference(x, p, s, s2)
    assert _rel(y, ref) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("n, k", [(1856, 2688), (2688, 1856)])
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_grouped_kernel_gpu(n, k, tokens):
    e, top_k = 128, 6
    w, s, s2 = _weights(n, k, seed=tokens, experts=e, device="cuda")
    topk = torch.stack([torch.randperm(e)[:top_k] for _ in range(tokens)]).cuda()
    order, offsets = tw.sort_by_expert(topk, e)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    xs = x[order // top_k]
    y = tw.grouped_w4a16(xs, offsets, w, s, s2)
    ref = tw.grouped_w4a16_reference(xs, offsets, w, s, s2)
    assert _rel(y, ref) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_nvfp4_linear_module_on_gpu_matches_cpu():
    from blockspec.quant.linear import make_quant_linear

    p, s, s2 = _weights(256, 512, seed=5)
    mod = make_quant_linear("w4a16_nvfp4", 512, 256, prefix="t")
    mod.weight.copy_(p), mod.weight_scale.copy_(s), mod.weight_scale_2.copy_(s2)
    x = torch.randn(8, 512).bfloat16()
    cpu = mod(x)
    gpu = mod.to("cuda")(x.cuda())
    assert mod.weight.dtype == torch.uint8 and mod.weight.is_cuda
    assert _rel(gpu.cpu(), cpu) <= 1e-2
