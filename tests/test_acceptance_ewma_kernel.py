"""The one-launch acceptance EWMA update against its torch reference on random tables, rows,
accept lengths and widths, padding rows on the dummy slot included (interpreter on CPU,
compiled with -m gpu)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels.acceptance_ewma import ewma_update_fused
from blockspec.speculative.adaptive import AcceptanceEWMA
from tests.triton_modes import MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("bs, positions, width, pad", [(1, 1, 2, 0), (1, 7, 1, 0), (5, 3, 4, 2),
                                                        (9, 7, 6, 3), (64, 15, 16, 7),
                                                        (100, 7, 5, 28)])
def test_ewma_kernel_equals_reference(mode, bs, positions, width, pad):
    g = torch.Generator().manual_seed(bs * 31 + positions * 7 + width)
    slots = bs + pad + 3
    ref = AcceptanceEWMA(slots, positions, torch.device("cpu"), alpha=0.25, engine_alpha=0.05)
    ref.table.copy_(torch.rand(ref.table.shape, generator=g))
    ref.engine.copy_(torch.rand(ref.engine.shape, generator=g))
    # distinct real slots, then padding rows on the dummy slot (the last)
    slot = torch.cat([torch.randperm(slots - 1, generator=g)[:bs],
                      torch.full((pad,), ref.dummy, dtype=torch.long)])
    ctr = torch.randint(0, 3, (bs + pad,), generator=g)           # some requests' first step
    ctr[0] = 0                       # one at least: a row moves even at width 1
    acc = torch.randint(0, max(width, 1), (bs + pad,), generator=g).clamp_max(width - 1)
    table, engine = ref.table.clone().to(mode), ref.engine.clone().to(mode)
    before = ref.table.clone()

    want = ref.update_reference(slot, ctr, acc, width)
    got = ewma_update_fused(table, engine, slot.to(mode), ctr.to(mode), acc.to(mode), width,
                            ref.dummy, ref.alpha, ref.engine_alpha)
    assert got.dtype == torch.float64 and got.shape == (bs + pad, 2 * positions)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(engine.cpu(), ref.engine, rtol=0, atol=1e-6)
    # every row but the dummy one (padding rows race to write it, and nothing reads it back)
    torch.testing.assert_close(table.cpu()[:-1], ref.table[:-1], rtol=0, atol=1e-6)
    assert not torch.equal(ref.table[:-1], before[:-1])      # the step moved some row
