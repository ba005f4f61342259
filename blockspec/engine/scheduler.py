"""Scheduler: admits requests by cache capacity, plans prefill chunks, runs one step at a time
(a prefill batch, or a decode / speculative step over every running request) and applies stop
rules (engine/stop.py). It owns the requests and the memory manager's reservations; tensors
stay inside the runner, the speculative worker and the model. Only the engine loop's thread
(engine/loop.py) drives it.

Decode steps overlap the host: while the running requests stay the same, each call launches
the next step (from the inputs the current one advances on the device) before it reads the
current one back, so appending tokens, stop checks and the loop's outputs run while the GPU
works. A request that finishes is therefore computed one step too far; that step's rows for
it are dropped (its reservation covers the extra positions, ``STEPS_IN_FLIGHT``), and a changed
batch (a finish, an admission, an abort) waits for the step in flight before it is filled anew.
A batch with a grammar-constrained request is never launched ahead: its next masks follow
from the tokens this step commits, which only the host's matchers know.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
from torch.profiler import record_function

from blockspec.cache import MemoryManager
from blockspec.engine.request import Request
from blockspec.engine.stop import append_tokens
from blockspec.runtime.metadata import StepBatch
from blockspec.runtime.model_runner import Launched, ModelRunner
from blockspec.sampling import request_seed


class Drafter(Protocol):
    """What the scheduler needs from a speculative worker (see blockspec/speculative/worker.py)."""

    lookahead: int

    def on_prefill(self, aux: torch.Tensor, rows: torch.Tensor) -> None: ...

    def launch(self, batch: StepBatch | None, prev: Launched | None = None) -> Launched: ...

    def results(self, step: Launched) -> list[tuple[int, list[int], list[float]]]: ...


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
        self._last_was_prefill = False
        self._arrivals = 0
        self._inflight: Launched | None = None    # launched, not yet read back (tag: its requests)

    def add(self, req: Request) -> None:
        self.check(req)
        # unseeded requests draw from a stream of --random-seed numbered by arrival order
        req.seed = request_seed(req.params.seed, self.seed, self._arrivals)
        self._arrivals += 1
        self.waiting.append(req)

    def check(self, req: Request) -> None:
        """Raise ValueError when ``req`` can never run here (read-only: any thread may call it)."""
        need = self.memory.needed_tokens(len(req.prompt_ids), req.params.max_new_tokens)
        if need > self.memory.total_tokens:
            raise ValueError(f"request needs {need} cache positions (prompt {len(req.prompt_ids)} + "
                             f"max_new_tokens {req.params.max_new_tokens}) but the cache holds "
                             f"{self.memory.total_tokens}; raise max_total_tokens")
        if not req.prompt_ids:
            raise ValueError("prompt is empty: give at least one token")

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
        self._retire([req for req in done if req.finished])
        return done

    def _step_batch(self, reqs: list[Request]) -> StepBatch:
        temps = [0.0 if r.params.is_greedy else float(r.params.temperature) for r in reqs]
        return StepBatch(
            slots=[r.cache.slot for r in reqs], prefix_lens=[r.num_cached for r in reqs],
            tokens=[r.output_ids[-1] if r.output_ids else 0 for r in reqs], temperature=temps,
            top_k=[int(r.params.top_k) for r in reqs], top_p=[float(r.params.top_p) for r in reqs],
            min_p=[float(r.params.min_p) for r in reqs], seeds=[r.seed for r in reqs],
            sample_counters=[len(r.output_ids) for r in reqs],
            verify_counters=[r.spec_verify_ct for r in reqs],
            want_logprobs=any(r.return_logprob for r in reqs),
            grammars=[r.grammar for r in reqs] if any(r.grammar is not None for r in reqs) else None)

    def _launch(self, reqs: list[Request] | None, prev: Launched | None = None) -> Launched:
        """A step for ``reqs`` filled from their host state, or (None) the step after ``prev``
        for the same requests, from the inputs ``prev`` advanced on the device."""
        batch = self._step_batch(reqs) if reqs is not None else None
        with record_function("decode.launch"):
            if self.drafter is None:
                step = self.runner.launch_step(batch, self.runner.decode_step, "decode", 1, prev)
            else:
                step = self.drafter.launch(batch, prev)
        step.tag = reqs if reqs is not None else prev.tag
        return step

    def _decode_step(self) -> list[Request]:
        """Read one step back and apply it; first launch the step after it when the running
        requests are still exactly the ones it ran for (see the module docstring)."""
        reqs = list(self.running)
        cur = self._inflight
        if cur is None:
            cur = self._launch(reqs)
        same = len(cur.tag) == len(reqs) and all(a is b for a, b in zip(cur.tag, reqs))
        # a grammar's next mask needs this step's tokens on the host: no step ahead
        same = same and not any(r.grammar is not None for r in reqs)
        self._inflight = self._launch(None, cur) if same else None
        with record_function("decode.readback"):
            if self.drafter is None:
                results = [(0, [int(tok)], [lp]) for tok, lp in self.runner.collect(cur)]
            else:
                results = self.drafter.results(cur)
        changed = []
        for req, (a, tokens, lps) in zip(cur.tag, results):
            if req.finished:            # finished (or aborted) after this step was launched
                continue
            req.num_cached += a + 1
            if self.drafter is not None:
                req.spec_verify_ct += 1
                if not req.spec_accept_histogram:
                    req.spec_accept_histogram = [0] * self.drafter.lookahead
                req.spec_accept_histogram[a] += 1
            self._append(req, tokens, lps)
            changed.append(req)
        self._retire([r for r in changed if r.finished])
        return changed

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

    # ---- stop rules (engine/stop.py) --------------------------------------------------------
    def _append(self, req: Request, tokens: list[int], logprobs: list[float] | None) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
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
        """(queued requests, requests holding cache, fraction of KV pages held)."""
        a = self.memory.allocator
        return len(self.waiting), len(self.prefilling) + len(self.running), 1 - a.num_free / a.num_blocks
