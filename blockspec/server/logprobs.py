"""The ``logprobs`` objects of OpenAI responses, from the engine's (logprob, token id) pairs.

* Completions: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
  {token text: logprob} dict per position, or None when no alternatives were asked for) and
  ``text_offset`` (each token's character offset in the choice's text). With ``echo`` the
  prompt's tokens come first, the first of them with a null logprob and null alternatives:
  what lm-eval's ``local-completions`` reads for loglikelihood.
* Chat: ``content``, one {token, logprob, bytes, top_logprobs} entry per output token.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], list[int] | None]
Pairs = Sequence[tuple[float | None, int]]
Tops = Sequence[Sequence[tuple[float, int]]]


def _by_text(token_text: TokenText, alts: Sequence[tuple[float, int]]) -> dict[str, float]:
    """{token text: logprob}; tokens whose texts coincide (byte pieces all showing U+FFFD)
    keep the most likely one's value, so the dict's best is the distribution's best."""
    out: dict[str, float] = {}
    for v, t in alts:
        out.setdefault(token_text(t), v)
    return out


def completion_logprobs(token_text: TokenText, lps: Pairs, tops: Tops | None, start: int,
                        prompt: tuple[Pairs, Tops] | None = None) -> dict:
    """``lps`` / ``tops``: the output tokens' (logprob, id) and alternatives (None: not asked
    for); ``start``: the text offset of the first token; ``prompt``: the echoed prompt's
    pairs and alternatives, put first."""
    pairs, alts = list(lps), list(tops) if tops is not None else None
    if prompt is not None:
        p_lps, p_tops = prompt
        pairs = list(p_lps) + pairs
        if alts is not None:
            alts = [None if lp is None else list(t) for (lp, _), t in zip(p_lps, p_tops)] + alts
    tokens = [token_text(t) for _, t in pairs]
    offsets, at = [], start
    for s in tokens:
        offsets.append(at)
        at += len(s)
    top = None
    if alts is not None:
        top = [None if a is None else _by_text(token_text, a) for a in alts]
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(token_text: TokenText, lps: Pairs, tops: Tops | None,
                  token_bytes: TokenBytes) -> dict:
    """``token_bytes``: a token's bytes, also where it holds part of a UTF-8 character (its
    text then shows U+FFFD), so a client can rebuild the exact text from the entries."""
    content = []
    for j, (lp, t) in enumerate(lps):
        alts = tops[j] if tops is not None and j < len(tops) else []
        content.append({"token": token_text(t), "logprob": lp, "bytes": token_bytes(t),
                        "top_logprobs": [{"token": token_text(a), "logprob": v,
                                          "bytes": token_bytes(a)} for v, a in alts]})
    return {"content": content}
