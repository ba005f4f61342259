"""Scheduler: admits requests by cache capacity, plans prefill chunks, runs one step at a time
(a prefill batch, or a decode / speculative step over every running request) and applies stop
rules. It owns the requests and the memory manager's reservations; tensors stay inside the
runner, the speculative worker and the model.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
from torch.profiler import record_function

from blockspec.engine.memory import MemoryManager
from blockspec.engine.request import Request
from blockspec.runtime.metadata import StepBatch
from blockspec.runtime.model_runner import ModelRunner
from blockspec.sampling import request_seed


class Drafter(Protocol):
    """What the scheduler needs from a speculative worker (see blockspec/speculative/worker.py)."""

    lookahead: int

    def on_prefill(self, aux: torch.Tensor, rows: torch.Tensor) -> None: ...

    def step(self, batch: StepBatch) -> list[tuple[int, list[int], list[float]]]: ...


class Scheduler:
    def __init__(self, runner: ModelRunner, memory: MemoryManager, *, eos_token_ids: list[int],
                 chunked_prefill_size: int, detokenize: Callable[[list[int]], str] | None = None,
                 drafter: Drafter | None = None, seed: int = 0) -> None:
        self.runner = runner
        self.memory = memory
        self.eos = set(eos_token_ids)
        self.chunk = chunked_prefill_size
        self.detokenize = detokenize
        self.drafter = drafter
        self.seed = seed
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        need = self.memory.needed_tokens(len(req.prompt_ids), req.params.max_new_tokens)
        if need > self.memory.total_tokens:
            raise ValueError(f"request needs {need} cache positions (prompt {len(req.prompt_ids)} + "
                             f"max_new_tokens {req.params.max_new_tokens}) but the cache holds "
                             f"{self.memory.total_tokens}; raise max_total_tokens")
        if not req.prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        req.seed = request_seed(req.params.seed, self.seed, req.rid)
        self.waiting.append(req)

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
        m = self.memory
        while self.waiting and len(self.prefilling) + len(self.running) < m.max_requests:
            req = self.waiting[0]
            need = m.needed_tokens(len(req.prompt_ids), req.params.max_new_tokens)
            if not m.can_admit(need):
                break
            self.waiting.popleft()
            req.cache = m.admit(need)
            self.prefilling.append(req)

    def _prefill_step(self) -> list[Request]:
        budget, chunks = self.chunk, []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(len(req.prompt_ids) - req.num_cached, budget)
            chunks.append((req, req.num_cached, req.num_cached + n))
            budget -= n
        out, rows = self.runner.extend([r.cache.slot for r, _, _ in chunks], [s for _, s, _ in chunks],
                                       [r.prompt_ids[s:e] for r, s, e in chunks])
        for req, _, e in chunks:
            req.num_cached = e
        if self.drafter is not None:
            self.drafter.on_prefill(out.aux_hidden, rows)
        done_rows = [i for i, (req, _, _) in enumerate(chunks) if req.prefilled]
        if not done_rows:
            return []
        done = [chunks[i][0] for i in done_rows]
        for req in done:
            self.prefilling.remove(req)
            if req.params.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
            else:
                self.running.append(req)
        live = [i for i, req in enumerate(done) if not req.finished]
        if live:
            reqs = [done[i] for i in live]
            logits = out.logits[torch.tensor([done_rows[i] for i in live], device=out.logits.device)]
            picked = self.runner.sample_rows(logits, self._step_batch(reqs)).cpu().tolist()
            for req, (tok, lp) in zip(reqs, picked):
                self._append(req, [int(tok)], [lp])
        return self._retire([req for req in done if req.finished])

    def _step_batch(self, reqs: list[Request]) -> StepBatch:
        temps = [0.0 if r.params.is_greedy else float(r.params.temperature) for r in reqs]
        return StepBatch(
            slots=[r.cache.slot for r in reqs], prefix_lens=[r.num_cached for r in reqs],
            tokens=[r.output_ids[-1] if r.output_ids else 0 for r in reqs], temperature=temps,
            top_k=[int(r.params.top_k) for r in reqs], top_p=[float(r.params.top_p) for r in reqs],
            min_p=[float(r.params.min_p) for r in reqs], seeds=[r.seed for r in reqs],
            sample_counters=[len(r.output_ids) for r in reqs],
            verify_counters=[r.spec_verify_ct for r in reqs],
            want_logprobs=any(r.return_logprob for r in reqs))

    def _decode_step(self) -> list[Request]:
        reqs = list(self.running)
        batch = self._step_batch(reqs)
        if self.drafter is None:
            with record_function("decode.step"):
                out = self.runner.run_step(batch, self.runner.decode_step, "decode", 1).tolist()
            for req, (tok, lp) in zip(reqs, out):
                req.num_cached += 1
                self._append(req, [int(tok)], [lp])
        else:
            with record_function("spec.step"):
                results = self.drafter.step(batch)
            for req, (a, tokens, lps) in zip(reqs, results):
                req.num_cached += a + 1
                req.spec_verify_ct += 1
                if not req.spec_accept_histogram:
                    req.spec_accept_histogram = [0] * self.drafter.lookahead
                req.spec_accept_histogram[a] += 1
                self._append(req, tokens, lps)
        return self._retire([r for r in reqs if r.finished])

    def _retire(self, finished: list[Request]) -> list[Request]:
        for req in finished:
            req.finished_time = time.perf_counter()
            if req in self.running:
                self.running.remove(req)
            self.memory.release(req.cache)
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
