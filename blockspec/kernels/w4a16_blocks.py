"""Row-block tables of the grouped W4A16 GEMM (``kernels/w4a16.grouped_w4a16``): blocks of
``block_m`` rows that never straddle two experts, so each program reads one expert's weights.
Built on the device without a host sync (CUDA-graph safe); at prefill sizes the block height
comes from the prefill table (``w4a16_prefill``)."""
from __future__ import annotations

import torch

from blockspec.kernels.w4a16_prefill import is_grouped_prefill, prefill_config


def pick_block_m(m: int) -> int:
    """Rows per block for ``m`` rows per expert at decode sizes (16, 32 or 64)."""
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def expert_blocks(expert_offsets: torch.Tensor, rows: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Row blocks of ``block_m`` that never straddle experts, built on device without a sync.

    Returns (expert id, first row, end row) per block and the (upper-bound) block count; blocks
    past the real count have first row == end row and exit at once.
    """
    dev = expert_offsets.device
    offsets = expert_offsets.to(torch.int64)
    e = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    nblk = (counts + block_m - 1) // block_m
    cum = torch.cumsum(nblk, 0)
    upper = -(-rows // block_m) + min(e, rows)
    b = torch.arange(upper, device=dev, dtype=torch.int64)
    expert = torch.searchsorted(cum, b, right=True)
    valid = expert < e
    ex = torch.clamp(expert, max=e - 1)
    first_blk = cum[ex] - nblk[ex]
    row0 = offsets[ex] + (b - first_blk) * block_m
    row1 = torch.minimum(row0 + block_m, offsets[ex + 1])
    row0 = torch.where(valid, row0, torch.zeros_like(row0))
    row1 = torch.where(valid, row1, torch.zeros_like(row1))
    return ex.to(torch.int32), row0.to(torch.int32), row1.to(torch.int32), upper


def grouped_blocks(expert_offsets: torch.Tensor, rows: int, *, block_m: int | None = None,
                   shape: tuple[int, int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Row-block table for ``grouped_w4a16``: (expert, row0, row1, count, block_m).

    ``block_m`` unnamed: at prefill sizes (``is_grouped_prefill``) the prefill table's for
    ``shape`` = (N, K) of the first projection that uses the table (the MoE's up projection),
    else one that fits the rows per expert."""
    e = expert_offsets.numel() - 1
    if block_m is None and is_grouped_prefill(rows, e):
        block_m = prefill_config("grouped", *(shape or (0, 0)), rows)["block_m"]
    if block_m is None:
        block_m = pick_block_m(max(1, rows // max(1, min(e, rows))))
    return (*expert_blocks(expert_offsets, rows, block_m), block_m)
