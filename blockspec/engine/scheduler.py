"""Scheduler: admits requests by cache capacity, plans prefill chunks, runs one step at a time
(a prefill batch, or a decode / speculative step over every running request), samples, and
applies stop rules (engine/stop.py). Works on requests and token ids; tensors stay inside the
runner/model. Only the engine loop's thread (engine/loop.py) drives it."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
from torch.profiler import record_function

from blockspec.engine.request import Request
from blockspec.engine.stop import append_tokens
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
        self._last_was_prefill = False

    @property
    def lookahead(self) -> int:
        return self.drafter.lookahead if self.drafter is not None else 0

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def check(self, req: Request) -> None:
        """Raise ValueError when ``req`` can never run here (read-only: any thread may call it)."""
        need = req.max_len(self.lookahead)
        if need > self.runner.total_tokens:
            raise ValueError(f"request needs {need} cache positions (prompt {len(req.prompt_ids)} + "
                             f"max_new_tokens {req.params.max_new_tokens}) but the cache holds "
                             f"{self.runner.total_tokens}; raise max_total_tokens")
        if not req.prompt_ids:
            raise ValueError("prompt is empty: give at least one token")

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one forward; returns the requests it changed (new tokens, or finished)."""
        self._admit()
        # While both have work, prefill chunks alternate with decode steps, so a long prompt
        # being prefilled does not stall the running streams.
        if self.prefilling and not (self.running and self._last_was_prefill):
            self._last_was_prefill = True
            return self._prefill_step()
        self._last_was_prefill = False
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
            self._retire([req for req in done if req.finished])
            return done
        return []

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
        self._retire([r for r in reqs if r.finished])
        return reqs

    def _sample_and_append(self, reqs: list[Request], logits: torch.Tensor) -> None:
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs], self.fallback)
        lps = logprobs_of(logits, tokens).tolist() if any(r.return_logprob for r in reqs) else None
        for b, (req, tok) in enumerate(zip(reqs, tokens.tolist())):
            self._append(req, [tok], [lps[b]] if lps is not None else None)

    def _retire(self, finished: list[Request]) -> list[Request]:
        for req in finished:
            if req in self.running:
                self.running.remove(req)
            self.runner.release(req)
            if self.drafter is not None:
                self.drafter.release(req)
            stopped_on_string = isinstance((req.finish_reason or {}).get("matched"), str)
            if self.detokenize is not None and not stopped_on_string:
                req.text = self.detokenize(req.output_ids)
        return finished

    # ---- stop rules (engine/stop.py) --------------------------------------------------------
    def _append(self, req: Request, tokens: list[int], logprobs: list[float] | None) -> None:
        append_tokens(req, tokens, logprobs, eos=self.eos, detokenize=self.detokenize)

    # ---- engine loop API (engine/loop.py) ------------------------------------------------------
    def abort(self, rid: object) -> Request | None:
        """Drop a request wherever it is (queued, prefilling or decoding) and free its KV blocks,
        Mamba slot and draft context now; None when no such request is here."""
        for queue in (self.waiting, self.prefilling, self.running):
            req = next((r for r in queue if r.rid == rid), None)
            if req is not None:
                queue.remove(req)
                req.finish_reason = {"type": "abort", "message": "aborted"}
                self._retire([req])
                return req
        return None

    def usage(self) -> tuple[int, int, float]:
        """(queued requests, requests holding cache, fraction of KV blocks held)."""
        a = self.runner.allocator
        return len(self.waiting), len(self.prefilling) + len(self.running), 1 - a.num_free / a.num_blocks
