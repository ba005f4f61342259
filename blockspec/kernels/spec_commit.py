"""A speculative step's bookkeeping after acceptance in one launch: the committed tokens, the
step's output columns, the acceptance EWMA and the inputs' advance. In torch ops
(``SpecWorker.commit_reference``) it is some 40 small kernels, which every speculative step
replays on top of its forwards; here it is one program over the whole batch."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_spec_commit_kernels.py")


def spec_commit_fused(acc: torch.Tensor, bonus: torch.Tensor, drafts: torch.Tensor,
                      inp: dict[str, torch.Tensor], *, width: int, gamma: int, dummy: int,
                      table: torch.Tensor | None = None, engine: torch.Tensor | None = None,
                      engine_n: torch.Tensor | None = None, ended: torch.Tensor | None = None,
                      stop: torch.Tensor | None = None, alpha: float = 0.0,
                      engine_alpha: float = 0.0, engine_prior_n: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(committed tokens [B, width] int64, output [B, 1 + 2 width + 2 gamma] fp64: accepted
    drafts, tokens, zero logprobs, the rows' EWMA and the engine row). With the EWMA's state
    (``AcceptanceEWMA.kernel_args()``; none of it: a fixed width, EWMA columns zero) it updates
    ``table`` [slots, gamma] / ``engine`` [gamma] and its sample counts ``engine_n`` [gamma],
    where a row whose request has committed one of the end-of-sequence ids ``stop`` (int64
    [S]), now or before (``ended`` [slots] int32, kept here), observes nothing. Advances
    ``inp``'s token, prefix, sample_ctr and verify_ctr in place, as
    ``SpecWorker.commit_reference`` does."""
    bs = acc.shape[0]
    toks = torch.empty(bs, width, dtype=torch.int64, device=acc.device)
    out = torch.empty(bs, 1 + 2 * width + 2 * gamma, dtype=torch.float64, device=acc.device)
    if not bs:
        return toks, out
    d = drafts if drafts.numel() == 0 or drafts.stride(-1) == 1 else drafts.contiguous()
    d = d if d.numel() else acc                     # width 1: no drafts (never read)
    has_ewma = table is not None
    n_stop = stop.numel() if has_ewma else 0
    load_kernels(_KERNELS)._spec_commit_kernel[(1,)](
        acc.contiguous(), bonus.contiguous(), d, inp["slot"], inp["verify_ctr"], inp["token"],
        inp["prefix"], inp["sample_ctr"], table if has_ewma else out,
        engine if has_ewma else out, engine_n if has_ewma else out,
        ended if has_ewma else out, out, toks,
        stop if n_stop else acc, bs, d.stride(0) if drafts.numel() else 0,
        int(dummy), float(alpha), float(engine_alpha), float(engine_prior_n), T=width, G=gamma,
        HAS_EWMA=has_ewma, N_STOP=n_stop,
        BLOCK_B=next_pow2(bs), BLOCK_T=next_pow2(width), BLOCK_G=next_pow2(max(gamma, 1)),
        **({} if interpreting() else {"num_warps": 4 if bs * (width + gamma) <= 4096 else 8}))
    return toks, out
