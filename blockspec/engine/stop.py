"""Stop rules and incremental detokenization: the two places where token ids meet text.

* ``append_tokens`` commits one step's tokens to a request one at a time and applies the stop
  rules (stop token ids, eos unless ignored, stop strings, max_new_tokens). A speculative step
  may commit several tokens; everything after the first stop is dropped.
* ``IncrementalDetokenizer`` turns a growing list of output ids into text deltas for streaming.
  A delta never ends inside a UTF-8 character and never shows text that may still turn out to
  be the start of a stop string, so the deltas concatenate to exactly the final text.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from blockspec.engine.request import Request

log = logging.getLogger("blockspec")

Detokenize = Callable[[list[int]], str]
REPLACEMENT = "\ufffd"     # what a decoder shows for bytes that do not (yet) form a character


def append_tokens(req: Request, tokens: list[int], logprobs: list[float] | None, *,
                  eos: set[int], detokenize: Detokenize | None, tops: list | None = None) -> None:
    """Append ``tokens`` to ``req.output_ids`` until a stop rule fires (then set
    ``req.finish_reason`` and drop the rest). A request's grammar sees every appended token
    and ends the request once it has accepted its stop token (even with ``ignore_eos``)."""
    p = req.params
    stop_ids = set(p.stop_token_ids or ())
    stops = p.stop_strings()
    for i, tok in enumerate(tokens):
        req.output_ids.append(tok)
        if req.return_logprob and logprobs is not None:
            req.output_logprobs.append((float(logprobs[i]), tok))
            if req.top_logprobs_num and tops is not None:
                req.output_top_logprobs.append(tops[i][:req.top_logprobs_num])
        ended = req.grammar is not None and req.grammar.accept(tok)
        if ended or tok in stop_ids or (not p.ignore_eos and tok in eos):
            req.finish_reason = {"type": "stop", "matched": tok}
        elif stops and detokenize is not None and _stop_string(req, stops, detokenize):
            pass
        elif len(req.output_ids) >= p.max_new_tokens:
            req.finish_reason = {"type": "length", "length": p.max_new_tokens}
        if req.finished:
            return


def _stop_string(req: Request, stops: list[str], detokenize: Detokenize) -> bool:
    """Check the newest tokens only: decoding a short tail per token keeps stop strings O(1) per
    step; a hit is confirmed and cut on the full text (at the earliest matching stop)."""
    window = 4 * max(len(s) for s in stops) + 4        # a character spans <= 4 byte tokens
    tail = detokenize(req.output_ids[-window:])
    if not any(s in tail for s in stops):
        return False
    text = detokenize(req.output_ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return False
    at, s = min(hits)
    req.text = text[:at]
    req.finish_reason = {"type": "stop", "matched": s}
    return True


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper start of some stop string: those
    characters may still become a stop string (and then never be shown)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    """Text deltas of one request's output ids (vLLM's prefix/read offsets scheme).

    Only ids whose decoded text ends on a complete character are turned into text; the window
    ``ids[prefix:read]`` is decoded again as left context, so tokenizers whose pieces depend on
    their left neighbour decode the same way as the whole sequence."""

    def __init__(self, decode: Detokenize, stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = [s for s in stops if s]
        self._prefix = 0      # ids before this index are part of self._text
        self._read = 0        # ids[prefix:read] = left context for the next decode
        self._text = ""       # stable text: complete characters only
        self._sent = 0        # characters of self._text already handed out

    def step(self, ids: list[int]) -> str:
        """The new text that is safe to show, given all output ids so far."""
        if len(ids) > self._read:
            left = self._decode(ids[self._prefix:self._read])
            full = self._decode(ids[self._prefix:])
            if len(full) > len(left) and not full.endswith(REPLACEMENT):
                self._text += full[len(left):]
                self._prefix, self._read = self._read, len(ids)
        safe = len(self._text) - held_back(self._text, self._stops)
        if safe <= self._sent:
            return ""
        delta = self._text[self._sent:safe]
        self._sent = safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the request's authoritative text: stop strings cut,
        trailing partial characters decoded as the decoder does)."""
        sent = self._text[:self._sent]
        if not final_text.startswith(sent):     # a decoder that is not prefix-stable
            log.warning("streamed text is not a prefix of the final text; the stream may differ")
            return final_text[len(sent):]
        self._sent = len(final_text)
        return final_text[len(sent):]
