"""Log-probabilities a step returns besides its tokens: the chosen token's, its top alternatives'
and, at prefill, every prompt token's given its prefix.

Every number is from log_softmax of the model's raw logits (before temperature, filters,
penalties and grammar masks), the convention of ``sampling.logprobs_of``; the chosen token's
value and its entry among the top alternatives come from the same tensor, so they are equal.
Steps compute a fixed ``TOP_LOGPROBS_MAX`` alternatives (one graph whatever a request asks
for); the host keeps as many as each request wants.
"""
from __future__ import annotations

import torch

TOP_LOGPROBS_MAX = 20
PROMPT_BLOCK_ROWS = 256      # prompt rows per log_softmax: bounds the fp32 copy of the logits


def top_width(vocab: int) -> int:
    """Alternatives a step computes (the vocabulary may be smaller than the maximum)."""
    return min(TOP_LOGPROBS_MAX, vocab)


def chosen_and_top(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of ``tokens`` [N], top-k logprobs [N, k] sorted descending, their ids [N, k])
    of logits [N, V]; device ops only."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    chosen = lsm.gather(1, tokens.to(lsm.device).long()[:, None]).squeeze(1)
    vals, ids = lsm.topk(k, dim=-1)
    return chosen, vals, ids


def pack_top(vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[..., k] values and ids -> [N, 2k] float64 output columns (values, then ids)."""
    n = vals.shape[0]
    return torch.cat([vals.reshape(n, -1).double(), ids.reshape(n, -1).double()], dim=1)


def unpack_top(row: list[float], k: int, positions: int = 1) -> list[list[tuple[float, int]]]:
    """The host side of ``pack_top`` for one output row: per position, (logprob, id) pairs."""
    vals, ids = row[: positions * k], row[positions * k: 2 * positions * k]
    return [[(vals[p * k + i], int(ids[p * k + i])) for i in range(k)] for p in range(positions)]


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int
                    ) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Row i of ``logits`` [n, V] scores ``targets[i]`` (the prompt token after it): the
    targets' logprobs and, with ``k`` > 0, each row's top-k, a block of rows at a time."""
    lps: list[float] = []
    tops: list[list[tuple[float, int]]] = []
    tgt = torch.tensor(targets, dtype=torch.long, device=logits.device)
    for at in range(0, len(targets), PROMPT_BLOCK_ROWS):
        block = logits[at: at + PROMPT_BLOCK_ROWS]
        lsm = torch.log_softmax(block.float(), dim=-1)
        lps += lsm.gather(1, tgt[at: at + PROMPT_BLOCK_ROWS, None]).squeeze(1).tolist()
        if k > 0:
            vals, ids = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
            tops += [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())]
    return lps, tops
