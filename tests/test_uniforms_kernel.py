"""The one-launch uniforms against the torch reference: the same bits for any seed (negative
and 64-bit ones included), counter, stream and width (interpreter on CPU, compiled with -m gpu)."""
from __future__ import annotations

import pytest
import torch

from tests.triton_modes import MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("stream, width", [(0, 1), (1, 5), (4, 7), (3, 33)])
def test_uniforms_kernel_equals_reference(mode, stream, width):
    from blockspec.kernels.uniforms import uniforms_fused
    from blockspec.sampling import uniforms_reference

    g = torch.Generator().manual_seed(stream * 100 + width)
    seeds = torch.randint(-(2 ** 62), 2 ** 62, (9,), generator=g)
    seeds[:3] = torch.tensor([0, -1, 2 ** 63 - 1])
    counters = torch.randint(0, 2 ** 32, (9,), generator=g)
    want = uniforms_reference(seeds, counters, stream, width)
    got = uniforms_fused(seeds.to(mode), counters.to(mode), stream, width)
    assert got.dtype == torch.float64 and got.shape == (9, width)
    assert torch.equal(got.cpu(), want)
    assert 0.0 <= float(got.min()) and float(got.max()) < 1.0
    assert len(set(got.flatten().tolist())) == got.numel()      # no repeats, no stuck lanes
