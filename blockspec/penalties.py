"""Logit processing that depends on what a request has seen: presence / frequency / repetition
penalties, logit_bias and min_new_tokens.

Everything a penalty reads lives in per-request-slot device buffers (``PenaltyState``): filled
on the host once when a request's prefill completes, then advanced on the device as tokens are
committed (``count_tokens``), so a step applies :func:`penalize` with no host read and can be
captured in a CUDA graph. Semantics (and the order they are applied in) follow vLLM:

1. ``logit_bias`` is added; 2. ``repetition_penalty`` r divides a logit > 0 and multiplies a
logit <= 0 of every token seen in the prompt or the output (HF / vLLM); 3. ``presence_penalty``
and ``frequency_penalty`` subtract ``presence * (count > 0) + frequency * count`` over OUTPUT
tokens (OpenAI); 4. while fewer than ``min_new_tokens`` output tokens exist, the EOS ids and the
request's stop_token_ids are masked to -inf.

Under speculation verify position j is judged with the counts including drafts 0..j-1 (it only
matters when those are accepted) and with output_len + j, so acceptance stays lossless.
"""
from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["LOGIT_BIAS_MAX", "PenaltyState", "count_tokens", "penalize", "penalty_error",
           "uses_penalties"]

LOGIT_BIAS_MAX = 100.0
MIN_TOKENS_LIMIT = 2**24          # stored in a float32 column: exact below this


def _real(x: Any) -> bool:
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:
        return False


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _show(x: Any) -> str:
    return f"an int of {x.bit_length()} bits" if _int(x) and x.bit_length() > 128 else repr(x)


def bias_token(key: Any) -> int | None:
    """A logit_bias key as a token id (an int, or a decimal string as JSON keys are), else None."""
    if _int(key):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20:
        return int(key)
    return None


def penalty_error(p: Any) -> tuple[str, str] | None:
    """(field, message) of the first malformed penalty field of SamplingParams ``p``, else None."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _real(v) or not -2 <= v <= 2:
            return name, f"{name} must be a number in [-2, 2], got {_show(v)}"
    v = p.repetition_penalty
    if not _real(v) or not 0 < v <= 2:
        return "repetition_penalty", f"repetition_penalty must be a number in (0, 2], got {_show(v)}"
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            return "logit_bias", ("logit_bias must be a dict of token id -> bias or None, got "
                                  f"{type(p.logit_bias).__name__}")
        for k, b in p.logit_bias.items():
            if bias_token(k) is None:
                return "logit_bias", f"logit_bias keys must be token ids (ints >= 0), got {_show(k)}"
            if not _real(b) or not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX:
                return "logit_bias", (f"logit_bias[{k!r}] must be a number in [-100, 100], "
                                      f"got {_show(b)}")
    v = p.min_new_tokens
    if not _int(v) or v < 0:
        return "min_new_tokens", f"min_new_tokens must be an int >= 0, got {_show(v)}"
    return None


def uses_penalties(p: Any) -> bool:
    """Some penalty field of ``p`` is on (the step then runs :func:`penalize`)."""
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1
                or p.logit_bias or p.min_new_tokens > 0)


class PenaltyState:
    """Per-request-slot buffers (row = cache slot, the dummy slot included), allocated once:
    a captured graph keeps reading the same storage. ``scalars`` columns are presence,
    frequency, repetition and min_new_tokens."""

    def __init__(self, slots: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.counts = torch.zeros(slots, vocab, dtype=torch.int32, device=device)   # output tokens
        self.seen = torch.zeros(slots, vocab, dtype=torch.bool, device=device)      # prompt tokens
        self.bias = torch.zeros(slots, vocab, dtype=torch.float32, device=device)
        self.ban = torch.zeros(slots, vocab, dtype=torch.bool, device=device)       # min-tokens ban
        self.scalars = torch.zeros(slots, 4, dtype=torch.float32, device=device)
        self.scalars[:, 2] = 1.0

    def fill(self, slot: int, prompt_ids: list[int], output_ids: list[int], p: Any,
             banned: list[int]) -> None:
        """Row ``slot`` for a request with SamplingParams ``p`` whose committed tokens are
        ``prompt_ids`` + ``output_ids`` (``banned``: its EOS and stop ids)."""
        dev, V = self.counts.device, self.vocab
        on = uses_penalties(p)
        self.scalars[slot] = torch.tensor(
            [p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
             min(p.min_new_tokens, MIN_TOKENS_LIMIT)] if on else [0.0, 0.0, 1.0, 0.0])
        self.bias[slot].zero_()
        if not on:
            return
        self.counts[slot] = torch.bincount(torch.tensor(output_ids, dtype=torch.long),
                                           minlength=V)[:V].to(dev, torch.int32)
        seen = torch.zeros(V, dtype=torch.bool)
        seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        self.seen[slot] = seen.to(dev)
        if p.logit_bias:
            ids = torch.tensor([bias_token(k) for k in p.logit_bias], dtype=torch.long)
            self.bias[slot] = torch.zeros(V).index_put_(
                (ids,), torch.tensor([float(b) for b in p.logit_bias.values()])).to(dev)
        ban = torch.zeros(V, dtype=torch.bool)
        if banned:
            ban[torch.tensor(sorted(set(banned)), dtype=torch.long)] = True
        self.ban[slot] = ban.to(dev)

    def views(self) -> dict[str, torch.Tensor]:
        return {"pen_counts": self.counts, "pen_seen": self.seen, "pen_bias": self.bias,
                "pen_ban": self.ban, "pen_scalars": self.scalars}


def penalize(logits: torch.Tensor, inp: dict[str, torch.Tensor],
             drafts: torch.Tensor | None = None) -> torch.Tensor:
    """Penalised fp32 logits (a new tensor). ``logits`` [B, V] (the next token) or [B, T, V]
    with ``drafts`` [B, T - 1] (verify rows: anchor, then one row per draft); ``inp`` holds the
    step's ``slot`` and ``sample_ctr`` (output tokens so far) and the ``PenaltyState`` views."""
    one = logits.dim() == 2
    x = logits.float()[:, None] if one else logits.float()
    B, T, V = x.shape
    slot = inp["slot"]
    sc = inp["pen_scalars"][slot]                                  # [B, 4]
    counts = inp["pen_counts"][slot][:, None]                      # [B, 1, V]
    if T > 1:           # counts at row j include drafts 0..j-1
        step = torch.zeros(B, T, V, dtype=torch.int32, device=x.device)
        step[:, 1:].scatter_(2, drafts.long()[..., None], 1)
        counts = counts + step.cumsum(1, dtype=torch.int32)
    x = x + inp["pen_bias"][slot][:, None]
    seen = inp["pen_seen"][slot][:, None] | (counts > 0)
    rep = sc[:, 2, None, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - sc[:, 0, None, None] * (counts > 0) - sc[:, 1, None, None] * counts
    made = inp["sample_ctr"][:, None] + torch.arange(T, device=x.device)       # [B, T]
    banned = (made.float() < sc[:, 3, None])[..., None] & inp["pen_ban"][slot][:, None]
    x = x.masked_fill(banned, float("-inf"))
    return x[:, 0] if one else x


def count_tokens(counts: torch.Tensor, slot: torch.Tensor, tokens: torch.Tensor,
                 valid: torch.Tensor | None = None) -> None:
    """``counts[slot[b], tokens[b, j]] += 1`` for every committed (``valid``) token, in place
    on the device (one scatter-add; padding rows land on the dummy slot's row)."""
    tokens = tokens[:, None] if tokens.dim() == 1 else tokens
    flat = (slot[:, None] * counts.shape[1] + tokens.long()).reshape(-1)
    add = (torch.ones_like(tokens, dtype=torch.int32) if valid is None
           else valid.to(torch.int32)).reshape(-1)
    counts.view(-1).scatter_add_(0, flat, add)
