"""The one-launch silu(gate) * up against the torch reference (interpreter on CPU, compiled
with -m gpu): fp32 within rounding of the exponential, bf16 within a few units in the last
place (two roundings, which the interpreter's bf16 emulation does not always do to nearest)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels.silu_mul import silu_mul, silu_mul_reference
from tests.triton_modes import MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 8), (7, 2 * 1000), (3, 2, 2 * 1300)])
def test_silu_mul_equals_reference(mode, dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    want = silu_mul_reference(x)
    got = silu_mul(x.to(mode))
    assert got.shape == want.shape and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=3e-2, atol=1e-2)
    torch.testing.assert_close(got.cpu(), want, **tol)
    # a strided input (the gate/up halves of a wider buffer's rows)
    wide = torch.cat([x, x], dim=-1)[..., : shape[-1]]
    torch.testing.assert_close(silu_mul(wide.to(mode)).cpu(), want, **tol)


def test_silu_mul_needs_both_halves():
    with pytest.raises(ValueError, match="must be even"):
        silu_mul(torch.zeros(2, 7))
