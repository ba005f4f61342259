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

With the prefix cache on (engine/prefix_checkpoints.py) admission resumes a request at its
cached prefix, prefill chunks end at Mamba checkpoints, and finished requests leave what they
committed in the cache.

A step that raises hurts only the request that made it fail (``recover``). Every step records
the requests it touches and their committed host state (``Mark``); after a failure those
suspects are rolled back to it and computed again from their tokens (a prefill of prompt +
output: a half-run forward may have advanced their Mamba state, which cannot be undone), so
none loses or repeats a token. A lone suspect is the culprit and ends with an error; several
are bisected: their halves run one at a time (everyone else waits) until the failing step is
reproduced by a single request or passed by all of them.

A batch with a grammar-constrained request runs in phases (``runtime/phases.py``): its next
masks follow from the tokens this step commits, which only the host's matchers know, so the
step ahead is begun (its forwards launched) before this one is read back and completed (masks
filled, the masked finish launched) after its tokens have reached the matchers.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol

import torch
from torch.profiler import record_function

from blockspec.cache import MemoryManager
from blockspec.engine.fair_queue import FairQueue, group_of
from blockspec.engine.prefix_checkpoints import admitted, after_chunks, chunk_end, hit_for, seal
from blockspec.engine.prompt_logprobs import logits_rows, record
from blockspec.engine.request import Mark, Request
from blockspec.engine.stop import append_tokens
from blockspec.runtime.metadata import StepBatch
from blockspec.runtime.model_runner import Launched, ModelRunner, Pending
from blockspec.sampling import request_seed


class Drafter(Protocol):
    """What the scheduler needs from a speculative worker (see blockspec/speculative/worker.py)."""

    lookahead: int

    def on_prefill(self, aux: torch.Tensor, rows: torch.Tensor) -> None: ...

    def launch(self, batch: StepBatch | None, prev: Launched | None = None) -> Launched: ...

    def begin(self, batch: StepBatch | None, prev: Launched | None = None) -> Pending: ...

    def results(self, step: Launched) -> list[tuple]:
        """Per request: (accepted drafts, committed tokens, their logprobs, their top
        alternatives or None)."""


# a request that was among the suspects of this many failed steps is ended even when the
# bisection never pins a failure on it alone (a failure that needs several requests together)
MAX_FAILED_STEPS = 8
INT64 = (-(2**63), 2**63)


class BadRow(ValueError):
    """A request's step row holds a value the int64 step buffer cannot (known culprit)."""

    def __init__(self, req: Request, message: str) -> None:
        super().__init__(message)
        self.req = req


class Scheduler:
    def __init__(self, runner: ModelRunner, memory: MemoryManager, *, eos_token_ids: list[int],
                 chunked_prefill_size: int, decoding_prefill_chunk_size: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None,
                 drafter: Drafter | None = None, seed: int = 0) -> None:
        self.runner = runner
        self.memory = memory
        self.eos = set(eos_token_ids)
        self.chunk = chunked_prefill_size
        # the chunk while requests decode: it sits between two of their steps
        self.decoding_chunk = min(decoding_prefill_chunk_size or chunked_prefill_size,
                                  chunked_prefill_size)
        self.detokenize = detokenize
        self.drafter = drafter
        self.seed = seed
        self.waiting = FairQueue()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.max_running: int | None = None    # fewer running requests than slots (a bench's batch)
        self._last_was_prefill = False
        self._arrivals = 0
        self._inflight: Launched | None = None    # launched, not yet read back (tag: its requests)
        self._resync = False            # the step in flight must not be continued on the device
        # fault isolation: what the step running now has touched (None between steps), their
        # marks, and the groups of suspects still to run alone (with the marks they failed at)
        self._touched: list[Request] | None = None
        self._marks: dict[int, Mark] = {}
        self._probe: deque[dict[int, tuple[Request, int]]] = deque()

    def add(self, req: Request) -> None:
        self.check(req)
        # unseeded requests draw from a stream of --random-seed numbered by arrival order
        req.seed = request_seed(req.params.seed, self.seed, self._arrivals)
        self._arrivals += 1
        self.waiting.append(req)

    def check(self, req: Request) -> None:
        """Raise ValueError when ``req`` can never run here (read-only: any thread may call it)."""
        if not req.prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        need = self.memory.needed_tokens(len(req.prompt_ids), req.params.max_new_tokens)
        if need > self.memory.total_tokens:
            # callers check the model's context first, so ``need`` is at most the context plus
            # the lookahead: raising the cache to it is advice that can work
            raise ValueError(f"request needs {need} cache positions (prompt {len(req.prompt_ids)} + "
                             f"max_new_tokens {req.params.max_new_tokens} + "
                             f"{self.memory.lookahead} in flight) but the cache holds "
                             f"{self.memory.total_tokens}; raise max_total_tokens to at least "
                             f"{need}")

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one forward; returns the requests it changed (new tokens, or finished). Should
        it raise, call ``recover`` before the next step."""
        self._touched, self._marks = [], {}
        self._admit()
        group = self._probe_group()
        prefilling = self.prefilling if group is None else [r for r in self.prefilling
                                                            if id(r) in group]
        running = self.running if group is None else [r for r in self.running if id(r) in group]
        # While both have work, prefill chunks (of at most ``decoding_chunk`` tokens) alternate
        # with decode steps, so a long prompt being prefilled stalls the running streams by
        # one short forward a token, not by its whole prefill.
        if prefilling and not (running and self._last_was_prefill):
            self._last_was_prefill = True
            changed = self._prefill_step(prefilling, self.decoding_chunk if running else self.chunk)
        else:
            self._last_was_prefill = False
            changed = self._decode_step(running) if running else []
        self._touched = None
        if group is not None:
            self._probe_passed(group)
        return changed

    def _touch(self, reqs: list[Request]) -> None:
        """``reqs`` are about to be changed by this step: remember their committed state."""
        for r in reqs:
            if id(r) not in self._marks:
                self._marks[id(r)] = r.mark()
                self._touched.append(r)

    def _admit(self) -> None:
        """Admit waiting requests group by group in turn (FairQueue); a group whose next
        request finds no room passes its turn, after preempting a request of a group that
        holds more than its share if it holds less (``_preempt_for``)."""
        m = self.memory

        hit = None

        def room(req: Request, need: int) -> bool:
            nonlocal hit
            hit = hit_for(m, req)               # looked up again: a preemption may change it
            cap = min(m.max_requests, self.max_running or m.max_requests)
            return len(self.prefilling) + len(self.running) < cap and m.can_admit(need, hit)

        progress = True
        while progress and self.waiting:
            progress = False
            for req in self.waiting.heads():
                need = m.needed_tokens(len(req.prompt_ids), req.params.max_new_tokens)
                while not room(req, need) and self._preempt_for(req):
                    pass
                if not room(req, need):
                    continue
                self._touch([req])              # should admission itself fail, it is the culprit
                req.cache = m.admit(need, hit)
                admitted(m, req, hit)           # resumes at the cached prefix, if any
                self._touched.remove(req)
                del self._marks[id(req)]
                self.waiting.take(req)
                self.prefilling.append(req)
                progress = True
                break                           # the turn order has changed: look again

    def _preempt_for(self, req: Request) -> bool:
        """Make room for ``req`` when its group holds less than a fair share of the request
        slots (slots / groups holding or waiting) and another group holds more: that group's
        latest admitted request goes back to the front of its queue, keeping its tokens (it is
        computed again when it is admitted next). True when one was preempted."""
        held = self.prefilling + self.running
        holding = Counter(group_of(r) for r in held)
        share = -(-self.memory.max_requests // len(set(holding) | set(self.waiting.groups())))
        mine = group_of(req)
        if holding[mine] >= share:
            return False
        over = [g for g, c in holding.items() if g != mine and c > share]
        if not over:
            return False
        victim_group = max(over, key=lambda g: holding[g])
        victim = next(r for r in reversed(held) if group_of(r) == victim_group)
        for queue in (self.prefilling, self.running):
            if victim in queue:
                queue.remove(victim)
        self.memory.release(victim.cache)
        victim.num_cached = 0           # its committed tokens are prefilled again
        self.waiting.requeue(victim)
        return True

    def _prefill_step(self, prefilling: list[Request], budget: int) -> list[Request]:
        chunks = []
        for req in prefilling:
            if budget <= 0:
                break
            total = len(req.context_ids)
            # a chunk ends at a prefix cache checkpoint inside it (its Mamba state is saved)
            e = chunk_end(self.memory, req.num_cached, min(total, req.num_cached + budget), total)
            chunks.append((req, req.num_cached, e))
            budget -= e - req.num_cached
        self._touch([r for r, _, _ in chunks])
        wanted, last, where = logits_rows(chunks)
        out, rows = self.runner.extend([r.cache.slot for r, _, _ in chunks], [s for _, s, _ in chunks],
                                       [r.context_ids[s:e] for r, s, e in chunks], rows=wanted)
        record(chunks, where, out.logits)
        for req, _, e in chunks:
            req.num_cached = e
        after_chunks(self.memory, chunks)
        if self.drafter is not None:
            self.drafter.on_prefill(out.aux_hidden, rows)
        done_rows = [i for i, (req, _, _) in enumerate(chunks) if req.prefilled]
        if not done_rows:
            return []
        done = [chunks[i][0] for i in done_rows]
        resumed = {id(r) for r in done if r.output_ids}     # computed again: the next input is known
        for req in done:
            self.prefilling.remove(req)
            if req.params.max_new_tokens == 0 and id(req) not in resumed:
                req.finish_reason = {"type": "length", "length": 0}
            else:
                self.running.append(req)
                self.runner.fill_penalties(req.cache.slot, req.prompt_ids, req.output_ids,
                                           req.params, [*self.eos, *(req.params.stop_token_ids or ())])
        live = [i for i, req in enumerate(done) if not req.finished and id(req) not in resumed]
        if live:
            reqs = [done[i] for i in live]
            batch = self._step_batch(reqs)
            picked = self.runner.sample_rows(out.logits, batch,
                                             [last[done_rows[i]] for i in live]).cpu().tolist()
            for req, (_, toks, lps, tops) in zip(reqs, self.runner.picked(picked, batch.sampling_key())):
                self._append(req, toks, lps, tops)
        self._retire([req for req in done if req.finished])
        return [req for req in done if id(req) not in resumed]

    def _step_batch(self, reqs: list[Request]) -> StepBatch:
        for r in reqs:          # a value the buffer cannot hold names its request, not the batch
            for what, v in (("top_k", r.params.top_k), ("seed", r.seed),
                            ("token", r.output_ids[-1] if r.output_ids else 0)):
                if not INT64[0] <= v < INT64[1]:
                    raise BadRow(r, f"request {r.rid}: {what} {v} does not fit the int64 step row")
        temps = [0.0 if r.params.is_greedy else float(r.params.temperature) for r in reqs]
        return StepBatch(
            slots=[r.cache.slot for r in reqs], prefix_lens=[r.num_cached for r in reqs],
            tokens=[r.output_ids[-1] if r.output_ids else 0 for r in reqs], temperature=temps,
            top_k=[int(r.params.top_k) for r in reqs], top_p=[float(r.params.top_p) for r in reqs],
            min_p=[float(r.params.min_p) for r in reqs], seeds=[r.seed for r in reqs],
            sample_counters=[len(r.output_ids) for r in reqs],
            verify_counters=[r.spec_verify_ct for r in reqs],
            want_logprobs=any(r.return_logprob for r in reqs),
            penalized=any(r.params.penalized for r in reqs),
            top_logprobs=any(r.top_logprobs_num > 0 for r in reqs),
            grammars=[r.grammar for r in reqs] if any(r.grammar is not None for r in reqs) else None)

    def _launch(self, reqs: list[Request] | None, prev: Launched | None = None) -> Launched:
        """A step for ``reqs`` filled from their host state, or (None) the step after ``prev``
        for the same requests, from the inputs ``prev`` advanced on the device."""
        batch = self._step_batch(reqs) if reqs is not None else None
        with record_function("decode.launch"):
            if self.drafter is None:
                step = self.runner.launch_decode(batch, prev)
            else:
                step = self.drafter.launch(batch, prev)
        step.tag = reqs if reqs is not None else prev.tag
        return step

    def _begin(self, prev: Launched) -> Pending:
        """The forwards of the constrained step after ``prev`` (same requests)."""
        with record_function("decode.launch"):
            if self.drafter is None:
                return self.runner.begin_decode(None, prev)
            return self.drafter.begin(None, prev)

    def _complete(self, pending: Pending, reqs: list[Request]) -> Launched:
        """Its masks from the matchers (which have taken every committed token), then its
        masked finish."""
        with record_function("decode.launch"):
            step = self.runner.phased.complete(pending, [r.grammar for r in reqs])
        step.tag = reqs
        return step

    def _decode_step(self, running: list[Request]) -> list[Request]:
        """Read one step back and apply it; first launch the step after it when the running
        requests are still exactly the ones it ran for (see the module docstring)."""
        reqs = list(running)
        cur = self._inflight
        if cur is None:
            self._touch(reqs)
            cur = self._launch(reqs)
        else:
            self._touch(cur.tag)
        same = (not self._resync and len(cur.tag) == len(reqs)
                and all(a is b for a, b in zip(cur.tag, reqs)))
        self._resync = False
        # a grammar's next masks need this step's tokens on the host: begin the next step
        # now, complete it once they have been appended
        ahead = None
        if same and cur.plan is not None:
            ahead, self._inflight = self._begin(cur), None
        else:
            self._inflight = self._launch(None, cur) if same else None
        with record_function("decode.readback"):
            if self.drafter is None:
                results = self.runner.picked(self.runner.collect(cur), cur.key)
            else:
                results = self.drafter.results(cur)
        changed = []
        live = {id(r) for r in self.running}
        for req, (a, tokens, lps, tops) in zip(cur.tag, results):
            if req.finished or id(req) not in live:   # finished, aborted or preempted since
                continue
            req.num_cached += a + 1
            if self.drafter is not None:
                req.count_verify(a, cur.width, self.drafter.lookahead)
            self._append(req, tokens, lps, tops)
            changed.append(req)
        if ahead is not None:
            self._inflight = self._complete(ahead, cur.tag)
        self._retire([r for r in changed if r.finished])
        return changed

    def _retire(self, finished: list[Request]) -> list[Request]:
        for req in finished:
            req.finished_time = time.perf_counter()
            if req in self.running:
                self.running.remove(req)
        # what they committed stays in the prefix cache for the next turn
        seal(self.runner, self.memory, self.drafter, self.chunk, finished)
        for req in finished:
            self.memory.release(req.cache)
            stopped_on_string = isinstance((req.finish_reason or {}).get("matched"), str)
            if self.detokenize is not None and not stopped_on_string:
                req.text = self.detokenize(req.output_ids)
        return finished

    # ---- stop rules (engine/stop.py) --------------------------------------------------------
    def _append(self, req: Request, tokens: list[int], logprobs: list[float] | None,
                tops: list | None = None) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        append_tokens(req, tokens, logprobs, eos=self.eos, detokenize=self.detokenize, tops=tops)

    # ---- fault isolation ---------------------------------------------------------------------
    def recover(self, error: BaseException) -> list[Request]:
        """After ``step`` raised: find who made it fail. Returns the requests to end with an
        error (removed, their cache released); every other request the step touched is back
        at its committed state and will be computed again, losing and repeating no token.
        Requests the step did not touch go on as they were."""
        touched, marks = self._touched, self._marks
        self._touched, self._marks = None, {}
        if isinstance(error, BadRow):
            suspects = [error.req]
        elif touched:
            suspects = touched
        else:       # it failed outside a step's own work: anyone holding cache may be to blame
            suspects = list(self.prefilling) + list(self.running) or list(self.waiting)[:1]
            marks = {id(r): r.mark() for r in suspects}
        if self._inflight is not None:
            ids = {id(r) for r in suspects}
            if any(id(r) in ids for r in self._inflight.tag):
                self._inflight = None           # ran ahead for suspects: computed again below
            else:
                self._resync = True             # valid, but the step inputs may be overwritten
        for req in suspects:
            req.failed_steps += 1
        group = self._probe[0] if self._probe else None
        if len(suspects) == 1 or isinstance(error, BadRow):
            culprits = suspects
        else:
            culprits = [r for r in suspects if r.failed_steps >= MAX_FAILED_STEPS]
        keep = [r for r in suspects if r not in culprits]
        for req in culprits:
            if id(req) in marks:
                req.roll_back(marks[id(req)])   # its last output is what it had committed
            self._drop(req)
        failed_at = {}
        for req in keep:
            mark = marks.get(id(req)) or req.mark()
            failed_at[id(req)] = (req, mark.cached)
            self._recompute(req, mark)
        if group is not None:       # bisecting already: the failing part replaces the group
            self._probe.popleft()
            rest = {k: v for k, v in group.items() if k not in failed_at and v[0] not in culprits}
            if rest:
                self._probe.appendleft(rest)
        if len(failed_at) > 1:
            items = list(failed_at.items())
            half = len(items) // 2
            self._probe.appendleft(dict(items[half:]))
            self._probe.appendleft(dict(items[:half]))
        elif failed_at:
            self._probe.appendleft(failed_at)
        return culprits

    def _drop(self, req: Request) -> None:
        """Remove ``req`` wherever it is and free its cache (it ends with an error)."""
        for queue in (self.waiting, self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
        if req.cache.slot >= 0:
            self.memory.release(req.cache)

    def _recompute(self, req: Request, mark: Mark) -> None:
        """Back to ``mark``, its cache state to be computed again by a prefill of its tokens.
        It keeps its reservation (same slot, same pages) when it still has one, but for pages
        shared through the prefix cache: those it gives up for fresh ones."""
        req.roll_back(mark)
        for queue in (self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
        if req.cache.slot >= 0 and req.cache.nodes:
            # it drops its prefix cache pages (others may read them) for fresh ones, or waits
            need = self.memory.needed_tokens(len(req.prompt_ids), req.params.max_new_tokens)
            self.memory.release(req.cache)
            if self.memory.can_admit(need):
                req.cache = self.memory.admit(need)
        if req.cache.slot >= 0:
            if self.memory.mamba is not None:
                self.memory.mamba.reset(req.cache.slot)
            self.prefilling.insert(0, req)
        elif req not in self.waiting:
            self.waiting.appendleft(req)

    def _probe_group(self) -> dict[int, tuple[Request, int]] | None:
        """The suspects that run alone this step (None: everyone runs). Members that finished
        or left are forgotten; a group none of whose members can run (all waiting for cache)
        is given up, so nothing waits on it forever."""
        while self._probe:
            group = self._probe[0]
            holding = {id(r) for r in self.prefilling} | {id(r) for r in self.running}
            for k in [k for k, (r, _) in group.items() if r.finished or k not in holding]:
                if group[k][0] not in self.waiting:
                    del group[k]
            if any(k in holding for k in group):
                return group
            self._probe.popleft()
        return None

    def _probe_passed(self, group: dict[int, tuple[Request, int]]) -> None:
        """Once every member has run past the point it failed at, the group is cleared."""
        if all(r.finished or r.num_cached > at for r, at in group.values()):
            if self._probe and self._probe[0] is group:
                self._probe.popleft()

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

    def prefix_usage(self) -> tuple[int, int, int]:
        """Prefix cache: (prompt tokens looked up, of those resumed, pages cached); zeros
        with the cache off."""
        p = self.memory.prefix
        return (p.queried_tokens, p.hit_tokens, p.cached_pages) if p is not None else (0, 0, 0)

    def usage(self) -> tuple[int, int, float]:
        """(queued requests, requests holding cache, fraction of KV pages held by requests:
        pages only the prefix cache holds are free for the taking)."""
        a = self.memory.allocator
        free = a.num_free + a.num_idle_cached
        return len(self.waiting), len(self.prefilling) + len(self.running), 1 - free / a.num_blocks
