"""Prompt logprobs (``logprob_start_len``), gathered chunk by chunk as the prefill runs: the row
of prompt position i scores prompt token i + 1, and each chunk asks the runner for the logits of
only the rows whose token is still unscored, so a long prompt never holds [L, V] at once. A
request computed again (after a failed step or a preemption) keeps what it has and scores only
what it lacks."""
from __future__ import annotations

import torch

from blockspec.engine.request import Request
from blockspec.runtime.logprobs import prompt_logprobs


def prompt_span(req: Request, start: int, end: int) -> tuple[int, int] | None:
    """Positions [i0, i1) of the chunk ``context[start:end]`` whose rows score a prompt token
    ``req`` still lacks (position p's logprob comes from row p - 1), or None."""
    first, n = req.logprob_start_len, len(req.prompt_ids)
    if first < 0 or first >= n:
        return None
    after = max(first + len(req.prompt_logprobs), 1) - 1       # the row of the next token
    i0, i1 = max(start, after), min(end, n - 1)
    return (i0, i1) if i0 < i1 else None


def logits_rows(chunks: list[tuple[Request, int, int]]
                ) -> tuple[list[int] | None, list[int], list[tuple[int, int, int] | None]]:
    """(flat rows the prefill's logits are wanted at, or None for each chunk's last row only;
    the index of each chunk's last row among them; per chunk (first index, i0, i1) of its
    prompt rows or None)."""
    spans = [prompt_span(r, s, e) for r, s, e in chunks]
    if all(sp is None for sp in spans):
        return None, list(range(len(chunks))), spans
    rows: list[int] = []
    last, where, offset = [], [], 0
    for (_, s, e), sp in zip(chunks, spans):
        if sp is None:
            where.append(None)
        else:
            where.append((len(rows), *sp))
            rows += range(offset + sp[0] - s, offset + sp[1] - s)
        last.append(len(rows))
        rows.append(offset + e - s - 1)
        offset += e - s
    return rows, last, where


def record(chunks: list[tuple[Request, int, int]], where: list[tuple[int, int, int] | None],
           logits: torch.Tensor) -> None:
    """Append each chunk's prompt logprobs (and top alternatives) to its request."""
    for (req, s, _), w in zip(chunks, where):
        if s == 0 and req.logprob_start_len == 0 and not req.prompt_logprobs:
            req.prompt_logprobs.append((None, req.prompt_ids[0]))      # nothing before it
            req.prompt_top_logprobs.append([])
        if w is None:
            continue
        at, i0, i1 = w
        targets = req.prompt_ids[i0 + 1:i1 + 1]
        lps, tops = prompt_logprobs(logits[at:at + i1 - i0], targets, req.top_logprobs_num)
        req.prompt_logprobs += list(zip(lps, targets))
        req.prompt_top_logprobs += tops if tops else [[] for _ in targets]
