"""Structured output: a request's grammar (JSON schema, any JSON object, regex, EBNF) compiled
with xgrammar against the model's tokenizer, a matcher per request, and the token bitmask that
masks the target's logits.

Why xgrammar: it compiles JSON schema, regex and EBNF to one pushdown automaton with token
masks precomputed per state, fills a vocabulary bitmask in microseconds on the host, and rolls
its state back by tokens, which is what verifying a drafted block needs: walk the drafts
through the matcher (one bitmask row per verify position), then roll back.

The bitmask format is xgrammar's: int32 words, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed; a row of -1 allows everything, so unconstrained rows of a batch are left
bit for bit as they were. :func:`mask_logits` is device ops only (no host read), so it can run
inside a captured CUDA graph.
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from blockspec.tokenizer import vocab_kind

__all__ = ["GrammarError", "GrammarCompiler", "Matcher", "KINDS", "bitmask_words", "mask_logits"]

# the SamplingParams field each kind comes from; json_object has no text
KINDS = ("json_schema", "json_object", "regex", "ebnf")
_CACHE_SIZE = 256
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A constraint that does not compile; the message names the request field."""


def bitmask_words(vocab: int) -> int:
    """int32 words per bitmask row for a vocabulary of ``vocab`` tokens."""
    return (vocab + 31) // 32


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., V] with every token the bitmask [..., W] disallows set to -inf (a new
    tensor; allowed entries keep their exact values).

    The int32 words are read as bytes (little-endian: byte ``t // 8`` holds token ``t``'s bit
    ``t % 8``), so unpacking is one broadcast AND with no gather over the vocabulary."""
    vocab = logits.shape[-1]
    dev = logits.device
    octets = bitmask.to(dev).contiguous().view(torch.uint8)                  # [..., 4W]
    bit = torch.ones(8, dtype=torch.uint8, device=dev) << torch.arange(8, dtype=torch.uint8, device=dev)
    allowed = ((octets[..., None] & bit) != 0).flatten(-2)[..., :vocab]     # [..., 32W] -> V
    return logits.masked_fill(~allowed, float("-inf"))


def _clean(err: Exception) -> str:
    """xgrammar's message without the C++ source location it starts with."""
    text = str(err).strip()
    return _CPP_PREFIX.sub("", text).strip() or type(err).__name__


class GrammarCompiler:
    """Compiles constraints for one tokenizer; compiled grammars are cached by (kind, text), so
    a schema sent with every request compiles once.

    ``backend`` is a ``tokenizers.Tokenizer``; ``vocab_size`` the model's (the logits' width:
    ids past the tokenizer's are never allowed); ``stop_token_ids`` end a completed grammar.
    Special tokens never match grammar text (their pieces are blanked). xgrammar is imported
    and the vocabulary converted by the first compile, so engines that never see a
    constraint never pay for it (nor need xgrammar installed)."""

    def __init__(self, backend: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._backend = backend
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted({t for t in stop_token_ids if 0 <= t < vocab_size})
        self._xgr: Any = None
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0      # grammars actually compiled (cache misses), for tests and stats

    def _ready(self) -> Any:
        """The xgrammar compiler, built on first use (under the lock)."""
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr  # lazy: an optional dependency (the `structured` extra)
                except ImportError:
                    raise GrammarError("structured output needs xgrammar: "
                                       "pip install 'blockspec[structured]'") from None
                vocab = [""] * self.vocab_size
                for piece, i in self._backend.get_vocab(with_added_tokens=True).items():
                    if i < self.vocab_size:
                        vocab[i] = piece
                for i, added in self._backend.get_added_tokens_decoder().items():
                    if added.special and i < self.vocab_size:
                        vocab[i] = ""
                kind, prefix = vocab_kind(json.loads(self._backend.to_str()))
                info = xgr.TokenizerInfo(vocab, xgr.VocabType[kind], vocab_size=self.vocab_size,
                                         stop_token_ids=self.stop_token_ids or None,
                                         add_prefix_space=prefix)
                self._xgr = xgr
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))
            return self._compiler

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of a constraint (cached); GrammarError names the field."""
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._ready()
        try:
            if kind == "json_schema":
                # no free whitespace: a model cannot stall in a whitespace run, and the
                # output is one line with json.dumps's default separators (", " and ": ")
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(text)
            else:
                raise GrammarError(f"unknown constraint kind {kind!r}; kinds: {', '.join(KINDS)}")
        except GrammarError:
            raise
        except Exception as e:      # xgrammar raises RuntimeError / ValueError from its parsers
            raise GrammarError(f"{kind}: does not compile: {_clean(e)}") from None
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, kind: str, text: str, extra_stop_ids: list[int] | None = None) -> "Matcher":
        """A fresh matcher for one request (its ``stop_token_ids`` also end the grammar)."""
        stops = sorted(set(self.stop_token_ids) | {t for t in extra_stop_ids or ()
                                                   if 0 <= t < self.vocab_size})
        compiled = self.compile(kind, text)
        return Matcher(self._xgr.GrammarMatcher(
            compiled, override_stop_tokens=stops or None, terminate_without_stop_token=not stops),
            self.vocab_size)


class Matcher:
    """One request's grammar state: advanced by committed tokens, probed (and rolled back) for
    the masks of a verify block."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one committed token; True once the grammar has ended. A token the
        grammar forbids means the masks were not applied: raise rather than emit it."""
        if not self._m.accept_token(int(token)):
            raise RuntimeError(f"token {token} violates the request's grammar (mask not applied?)")
        return self._m.is_terminated()

    def fill(self, rows: torch.Tensor, drafts: list[int] = ()) -> None:
        """Bitmask rows [n + 1, W] (host, int32) for a block ``drafts`` of n tokens: row j is
        the mask after the committed tokens and ``drafts[:j]``. After a draft the grammar
        rejects, or after the grammar ends, the remaining rows allow everything: the
        acceptance stops at or before that draft, so those rows are never used. The matcher
        is rolled back to where it was."""
        walked = 0
        for j in range(rows.shape[0]):
            if self._m.is_terminated():
                rows[j:] = -1
                break
            self._m.fill_next_token_bitmask(rows, j)
            if j == len(drafts) or j == rows.shape[0] - 1:
                break
            if not self._m.accept_token(int(drafts[j])):
                rows[j + 1:] = -1
                break
            walked += 1
        if walked:
            self._m.rollback(walked)
