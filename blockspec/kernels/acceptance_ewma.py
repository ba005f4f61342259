"""The adaptive chooser's acceptance EWMA update in one launch. The torch form is about 26
small kernels (gather, masks, two blends, the engine row's sums), which every adaptive
speculative step replays; here it is one program over the whole batch."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_acceptance_ewma_kernels.py")


def ewma_update_fused(table: torch.Tensor, engine: torch.Tensor, slot: torch.Tensor,
                      verify_ctr: torch.Tensor, accepted: torch.Tensor, width: int, dummy: int,
                      alpha: float, engine_alpha: float) -> torch.Tensor:
    """``AcceptanceEWMA.update_reference`` on ``table`` [slots, P] and ``engine`` [P] (fp32,
    updated in place) for rows ``slot`` / ``verify_ctr`` / ``accepted`` [B]; returns the step's
    columns [B, 2P] fp64: the rows' new values, then the new engine row in every row."""
    bs, p = slot.shape[0], table.shape[1]
    out = torch.empty(bs, 2 * p, dtype=torch.float64, device=table.device)
    if bs:
        load_kernels(_KERNELS)._ewma_update_kernel[(1,)](
            table, engine, slot.contiguous(), verify_ctr.contiguous(), accepted.contiguous(),
            out, bs, p, int(width), int(dummy), float(alpha), float(engine_alpha),
            BLOCK_B=next_pow2(bs), BLOCK_P=next_pow2(p),
            **({} if interpreting() else {"num_warps": 4 if bs * p <= 2048 else 8}))
    return out
