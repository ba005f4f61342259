"""Scheduler: admits requests by cache capacity, plans prefill chunks, runs one step at a time
(a prefill batch, or a decode / speculative step over every running request), samples, and
applies stop rules. Works on requests and token ids; tensors stay inside the runner/model."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
from torch.profiler import record_function

from blockspec.engine.request import Request
from blockspec.runtime.model_runner import ModelRunner
from blockspec.sampling import logprobs_of, sample


class Drafter(Protocol):
    """What the scheduler needs from a speculative worker (see blockspec/speculative/worker.py)."""

    lookahead: int

    def on_prefill(self, chunks: list[tuple[Request, int, int]], aux_hidden: torch.Tensor) -> None: ...

    def step(self, reqs: list[Request]) -> list[tuple[list[int], list[float] | None]]: ...

    def release(self, req: Request) -> None: ...


class Scheduler:
    def __init__(self, runner: ModelRunner, *, eos_token_ids: list[int], chunked_prefill_size: int,
                 detokenize: Callable[[list[int]], str] | None = None,
                 drafter: Drafter | None = None, seed: int = 0) -> None:
        self.runner = runner
        self.eos = set(eos_token_ids)
        self.chunk = chunked_prefill_size
        self.detokenize = detokenize
        self.drafter = drafter
        self.fallback = torch.Generator(device=runner.device).manual_seed(seed)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []

    @property
    def lookahead(self) -> int:
        return self.drafter.lookahead if self.drafter is not None else 0

    def add(self, req: Request) -> None:
        need = req.max_len(self.lookahead)
        if need > self.runner.total_tokens:
            raise ValueError(f"request needs {need} cache positions (prompt {len(req.prompt_ids)} + "
                             f"max_new_tokens {req.params.max_new_tokens}) but the cache holds "
                             f"{self.runner.total_tokens}; raise max_total_tokens")
        if not req.prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one forward; returns the requests that finished in it."""
        self._admit()
        if self.prefilling:
            return self._prefill_step()
        if self.running:
            return self._decode_step()
        return []

    def _admit(self) -> None:
        r = self.runner
        while self.waiting and len(self.prefilling) + len(self.running) < r.max_running_requests:
            req = self.waiting[0]
            need = req.max_len(self.lookahead)
            if not r.can_admit(need):
                break
            self.waiting.popleft()
            r.admit(req, need)
            self.prefilling.append(req)

    def _prefill_step(self) -> list[Request]:
        budget, chunks = self.chunk, []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(len(req.prompt_ids) - req.num_cached, budget)
            chunks.append((req, req.num_cached, req.num_cached + n))
            budget -= n
        out = self.runner.extend(chunks)
        if self.drafter is not None:
            self.drafter.on_prefill(chunks, out.aux_hidden)
        done_rows = [i for i, (req, _, _) in enumerate(chunks) if req.prefilled]
        finished = []
        if done_rows:
            done = [chunks[i][0] for i in done_rows]
            logits = out.logits[torch.tensor(done_rows, device=out.logits.device)]
            for req in done:
                self.prefilling.remove(req)
                if req.params.max_new_tokens == 0:
                    req.finish_reason = {"type": "length", "length": 0}
                else:
                    self.running.append(req)
            live = [i for i, req in enumerate(done) if not req.finished]
            if live:
                self._sample_and_append([done[i] for i in live], logits[torch.tensor(live, device=logits.device)])
            finished = [req for req in done if req.finished]
        return self._retire(finished)

    def _decode_step(self) -> list[Request]:
        reqs = list(self.running)
        if self.drafter is None:
            with record_function("decode.forward"):
                out = self.runner.decode(reqs)
            with record_function("decode.sample"):
                self._sample_and_append(reqs, out.logits)
        else:
            for req, (tokens, lps) in zip(reqs, self.drafter.step(reqs)):
                self._append(req, tokens, lps)
        return self._retire([r for r in reqs if r.finished])

    def _sample_and_append(self, reqs: list[Request], logits: torch.Tensor) -> None:
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs], self.fallback)
        lps = logprobs_of(logits, tokens).tolist() if any(r.return_logprob for r in reqs) else None
        for b, (req, tok) in enumerate(zip(reqs, tokens.tolist())):
            self._append(req, [tok], [lps[b]] if lps is not None else None)

    def _retire(self, finished: list[Request]) -> list[Request]:
        for req in finished:
            req.finished_time = time.perf_counter()
            if req in self.running:
                self.running.remove(req)
            self.runner.release(req)
            if self.drafter is not None:
                self.drafter.release(req)
            stopped_on_string = isinstance((req.finish_reason or {}).get("matched"), str)
            if self.detokenize is not None and not stopped_on_string:
                req.text = self.detokenize(req.output_ids)
        return finished

    # ---- stop rules --------------------------------------------------------------------------
    def _append(self, req: Request, tokens: list[int], logprobs: list[float] | None) -> None:
        p = req.params
        stop_ids = set(p.stop_token_ids or ())
        stops = p.stop_strings()
        if not req.output_ids:
            req.first_token_time = time.perf_counter()
        for i, tok in enumerate(tokens):
            req.output_ids.append(tok)
            if req.return_logprob and logprobs is not None:
                req.output_logprobs.append((float(logprobs[i]), tok))
            if tok in stop_ids or (not p.ignore_eos and tok in self.eos):
                req.finish_reason = {"type": "stop", "matched": tok}
            elif stops and self.detokenize is not None and self._stop_string(req, stops):
                pass
            elif len(req.output_ids) >= p.max_new_tokens:
                req.finish_reason = {"type": "length", "length": p.max_new_tokens}
            if req.finished:
                return

    def _stop_string(self, req: Request, stops: list[str]) -> bool:
        """Check the newest tokens only: decoding a short tail per token keeps stop strings
        O(1) per step; a hit is confirmed and cut on the full text."""
        window = 4 * max(len(s) for s in stops) + 4        # a character spans <= 4 byte tokens
        tail = self.detokenize(req.output_ids[-window:])
        if not any(s in tail for s in stops):
            return False
        text = self.detokenize(req.output_ids)
        hits = [(text.find(s), s) for s in stops if s in text]
        if not hits:
            return False
        at, s = min(hits)
        req.text = text[:at]
        req.finish_reason = {"type": "stop", "matched": s}
        return True
