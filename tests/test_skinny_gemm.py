"""The skinny GEMM against ``F.linear`` on fresh random inputs: the Triton interpreter on CPU,
compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.kernels import skinny_gemm as sg
from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")

_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2e-2),
        torch.float16: dict(rtol=2 ** -10, atol=2e-3)}


def _inputs(m, n, k, dtype, dev, seed, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, m, k, generator=g).to(dev, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype)
    b = torch.randn(n, generator=g).to(dev, dtype)
    return x, w, b


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 33, 300), (8, 100, 128), (5, 17, 1000)])
def test_matches_f_linear(mode, dtype, m, n, k):
    x, w, b = _inputs(m, n, k, dtype, mode, seed=m * n + k)
    for bias in (None, b):
        out = sg.skinny_gemm(x, w, bias, block_n=16, block_k=64)
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
        assert out.dtype == dtype and out.shape == (m, n)
        torch.testing.assert_close(out, ref, **_TOL[dtype])


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_widens_into_fp32_output_and_keeps_leading_dims(mode):
    x, w, _ = _inputs(2, 24, 96, torch.bfloat16, mode, seed=1, lead=(3,))
    x = x[:1]                                            # [1, 2, 96]: 2 rows under a lead dim
    out = sg.skinny_gemm(x, w, out_dtype=torch.float32, block_n=8, block_k=32)
    assert out.shape == (1, 2, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_strided_and_offset_operands(mode):
    """A slice of a fused weight (row offset) and a column-strided x, as the draft passes."""
    x, w, _ = _inputs(4, 64, 160, torch.float32, mode, seed=2)
    w_view = w[16:48]                                    # rows of a stacked weight
    x_view = torch.cat([x, x], dim=1)[:, ::2]            # last dim strided
    out = sg.skinny_gemm(x_view, w_view)
    torch.testing.assert_close(out, F.linear(x_view, w_view), rtol=1e-5, atol=1e-5)


def test_dispatch_rules():
    x = torch.zeros(9, 64)
    w = torch.zeros(32, 64)
    assert not sg.skinny_ok(x, w)                        # too many rows
    assert sg.skinny_ok(x[:8], w)
    assert not sg.skinny_ok(x[:1], torch.zeros(sg.MAX_COLUMNS, 64))   # lm_head-sized: cuBLAS
    assert not sg.skinny_ok(x[:1], torch.zeros(64, 32).t())           # K not contiguous
    # CPU tensors never take the kernel
    torch.testing.assert_close(sg.linear(x[:2], w + 1), F.linear(x[:2], w + 1))
    with pytest.raises(ValueError, match="needs <= 8 rows"):
        sg.skinny_gemm(x, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linear_module_takes_the_kernel_on_cuda(monkeypatch):
    from blockspec.layers.linear import Linear

    calls = []
    real = sg.skinny_gemm
    monkeypatch.setattr(sg, "skinny_gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    lin = Linear(256, 96, bias=True, dtype=torch.bfloat16).cuda()
    lin.weight.data.normal_()
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = lin(x)
    assert calls
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=2 ** -7, atol=5e-2)
