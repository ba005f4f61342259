"""The one-launch relu(x)^2 against the torch reference on fresh random inputs, bit for bit: the
Triton interpreter on CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels.relu2 import relu2, relu2_reference
from tests.triton_modes import MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3712), (4, 1856), (3, 5, 7), (2049,)])
def test_matches_torch_bitwise(mode, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])).to(mode, dtype)
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, -1.0], dtype=dtype)
    out = relu2(x)
    ref = relu2_reference(x)
    assert out.shape == x.shape and out.dtype == dtype
    if mode.type == "cpu" and dtype == torch.bfloat16:
        # the interpreter casts fp32 to bf16 by truncation: at most one ulp below torch
        ulp = (ref.float().abs() * 2 ** -7).clamp_min(2 ** -133)
        assert ((ref.float() - out.float()) <= ulp).all() and (out <= ref).all()
    else:
        assert torch.equal(out, ref)
    assert (out > 0).any() and (out == 0).any()


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_strided_input(mode):
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).to(mode)
    view = x[1:5, ::2]
    assert torch.equal(relu2(view), relu2_reference(view))
