"""The engine loop: one thread owns the scheduler and steps it while there is work; any thread
submits requests, aborts them and reads their outputs, at any time.

Requests and aborts go through an inbox that the loop drains between steps, so only the loop's
thread ever touches the scheduler, and a request submitted mid-stream joins the running batch
at the next step (continuous batching). Every step's changes leave as ``StreamOutput``s through
each request's sink, a callable that must not block (``queue.put`` for a blocking client,
``loop.call_soon_threadsafe(...)`` for an asyncio one): the loop knows nothing of HTTP or
asyncio, and the offline ``Engine.generate`` is just another client.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from blockspec.engine.request import Request
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.stop import Detokenize, IncrementalDetokenizer

log = logging.getLogger("blockspec")


class EngineClosedError(RuntimeError):
    """The loop was shut down; it takes no more requests."""


@dataclass
class StreamOutput:
    """What one step changed for one request. Concatenating ``token_ids``, ``text`` and
    ``logprobs`` over a request's outputs gives its whole result; the last output has
    ``finish_reason`` and the full ``meta_info``."""

    rid: str
    token_ids: list[int]
    text: str                                   # safe text delta (see engine/stop.py)
    logprobs: list[tuple[float, int]]           # (logprob, token id) per new token, when asked
    meta_info: dict                             # id, prompt/completion tokens; all of it at the end
    finish_reason: dict | None = None           # stop / length / abort / error (with "message")
    accept_lengths: list[int] = field(default_factory=list)   # tokens committed per verify, bonus incl.
    verify_widths: list[int] = field(default_factory=list)    # the width of each of those verifies
    time: float = 0.0                           # time.monotonic() when the output left the loop
    # with top_logprobs_num: the top (logprob, id) alternatives of each new token
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # with logprob_start_len >= 0, once (the first output): the prompt's (logprob, id) from
    # that position (position 0's logprob is None) and their top alternatives
    prompt_logprobs: list[tuple[float | None, int]] | None = None
    prompt_top_logprobs: list[list[tuple[float, int]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Sink = Callable[[StreamOutput], None]


@dataclass(frozen=True)
class LoopStats:
    """A snapshot published after every loop iteration; safe to read from any thread."""

    waiting: int = 0            # submitted, holding no cache yet
    running: int = 0            # holding cache: prefilling or decoding
    cache_usage: float = 0.0    # fraction of KV blocks held
    prefix_queried: int = 0     # prefix cache: prompt tokens looked up at admission,
    prefix_hits: int = 0        # of those resumed from the cache,
    prefix_pages: int = 0       # and the pages it holds now
    steps: int = 0              # forward steps run so far
    alive: bool = True


@dataclass
class _Live:
    req: Request
    sink: Sink
    detok: IncrementalDetokenizer | None       # streaming requests with a tokenizer only
    stream: bool = True                        # False: only the final output is sent
    sent_ids: int = 0
    sent_logprobs: int = 0
    sent_prompt: bool = False
    histogram: list[int] = field(default_factory=list)   # spec_accept_histogram last reported
    widths: list[int] = field(default_factory=list)      # spec_width_histogram last reported


class EngineLoop:
    def __init__(self, scheduler: Scheduler, *, detokenize: Detokenize | None,
                 speculative: bool, name: str = "blockspec-engine-loop") -> None:
        self._sched = scheduler
        self._detokenize = detokenize
        self._speculative = speculative
        self._cv = threading.Condition(threading.RLock())   # re-entrant: see grouped()
        self._inbox: deque[tuple] = deque()        # ("add", _Live) | ("abort", rid, Event | None)
        self._known: set[str] = set()               # ids submitted and not finished (under _cv)
        self._closing: str | None = None
        self._live: dict[str, _Live] = {}           # loop thread only
        self._steps = 0
        self._outbox: list[tuple[_Live, StreamOutput]] = []     # loop thread only
        self._acks: list[threading.Event] = []
        self.stats = LoopStats()
        self._thread = threading.Thread(target=self._guarded_run, name=name, daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------
    def submit(self, req: Request, sink: Sink, *, stream: bool = True) -> None:
        """Queue ``req``; its outputs go to ``sink`` from the loop thread. Non-streaming
        requests get one output at the end (no per-step outputs, no per-step detokenizing:
        a blocking client then sleeps until its result is ready)."""
        detok = None
        if stream and self._detokenize is not None:
            detok = IncrementalDetokenizer(self._detokenize, req.params.stop_strings())
        with self._cv:
            if self._closing is not None:
                raise EngineClosedError(f"the engine loop is closed ({self._closing})")
            if req.rid in self._known:
                raise ValueError(f"request id {req.rid!r} is already in use")
            self._known.add(req.rid)
            self._inbox.append(("add", _Live(req, sink, detok, stream)))
            self._cv.notify()

    @contextlib.contextmanager
    def grouped(self) -> Iterator[None]:
        """Submissions inside the block reach the loop together (it cannot drain the inbox
        half-way), so one generate call's requests start in the same step: the batch, and with
        it every float, does not depend on thread timing."""
        with self._cv:
            yield

    def abort(self, rid: str, *, wait: float | None = None) -> bool:
        """Abort a queued or running request: it ends with finish_reason ``abort`` and its cache
        is freed before the next step. False when no such request is live. With ``wait``
        (seconds), return only once the loop has freed it."""
        done = threading.Event() if wait else None
        with self._cv:
            if rid not in self._known or self._closing is not None:
                return False
            self._inbox.append(("abort", rid, done))
            self._cv.notify()
        if done is not None:
            done.wait(wait)
        return True

    def close(self, reason: str = "the engine was shut down", timeout: float | None = 30.0) -> None:
        """End every live request with an ``error`` finish and stop the thread (idempotent)."""
        with self._cv:
            if self._closing is None:
                self._closing = reason
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the loop thread ---------------------------------------------------------------------
    def _guarded_run(self) -> None:
        """Should the loop itself break, end every request instead of leaving clients waiting."""
        try:
            self._run()
        except BaseException as e:      # noqa: BLE001
            log.exception("engine loop crashed")
            with self._cv:
                self._closing = self._closing or f"engine loop crashed: {type(e).__name__}: {e}"
                self._inbox.clear()
            try:
                self._fail_all(self._closing, closed=True)
                self._flush(alive=False)
            except Exception:       # noqa: BLE001
                log.exception("could not end the requests of the crashed loop")
                self.stats = LoopStats(alive=False)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._live and self._closing is None:
                    self._cv.wait()
                commands = list(self._inbox)
                self._inbox.clear()
                closing = self._closing
            for cmd in commands:
                self._apply(cmd)
            if closing is not None:
                self._fail_all(closing, closed=True)
                self._flush(alive=False)
                return
            if self._outbox or self._acks:       # aborts answered before the next step runs
                self._flush()
            if self._live:
                try:
                    changed = self._sched.step()
                except Exception as e:      # noqa: BLE001 - a failed step must not kill the server
                    if getattr(e, "fatal", False):
                        raise               # e.g. tensor-parallel ranks out of step: no retry
                    self._isolate(e)
                else:
                    self._steps += 1
                    self._emit(changed)
            self._flush()

    def _flush(self, alive: bool = True) -> None:
        """Publish the stats, then hand out this iteration's outputs and acknowledge aborts, so
        whoever sees an output or an acknowledgement also sees stats at least this fresh."""
        waiting, running, usage = self._sched.usage()
        with self._cv:
            inbox = sum(1 for c in self._inbox if c[0] == "add")
        queried, hits, pages = self._sched.prefix_usage()
        self.stats = LoopStats(waiting=waiting + inbox, running=running, cache_usage=usage,
                               steps=self._steps, alive=alive, prefix_queried=queried,
                               prefix_hits=hits, prefix_pages=pages)
        outbox, self._outbox = self._outbox, []
        for live, out in outbox:
            try:
                live.sink(out)
            except Exception:       # noqa: BLE001 - a client's broken sink must not stop the loop
                log.exception("output sink of request %s failed; aborting it", live.req.rid)
                if self._live.pop(live.req.rid, None) is not None:
                    self._sched.abort(live.req.rid)
                    with self._cv:
                        self._known.discard(live.req.rid)
        acks, self._acks = self._acks, []
        for done in acks:
            done.set()

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            live: _Live = cmd[1]
            try:
                self._sched.add(live.req)
            except ValueError as e:
                self._finish(live, {"type": "error", "message": str(e)})
            else:
                self._live[live.req.rid] = live
            return
        _, rid, done = cmd
        live = self._live.pop(rid, None)
        if live is not None:
            self._sched.abort(rid)
            self._finish(live, {"type": "abort", "message": "aborted"})
        if done is not None:
            self._acks.append(done)

    def _isolate(self, error: Exception) -> None:
        """A step raised: end only the request(s) the scheduler finds to blame; the others
        were rolled back and go on. Should that itself fail, end everything the step held."""
        message = f"engine step failed: {type(error).__name__}: {error}"
        log.error("%s; isolating the request that caused it", message, exc_info=error)
        try:
            culprits = self._sched.recover(error)
        except Exception:       # noqa: BLE001
            log.exception("could not isolate the failed step; ending every request")
            self._fail_all(message)
            return
        for req in culprits:
            live = self._live.pop(req.rid, None)
            if live is not None:
                self._finish(live, {"type": "error", "message": message})

    def _fail_all(self, message: str, closed: bool = False) -> None:
        """End every live request with an ``error`` finish (``closed``: the loop is stopping)."""
        reason = {"type": "error", "message": message, **({"closed": True} if closed else {})}
        for rid in list(self._live):
            live = self._live.pop(rid)
            try:
                self._sched.abort(rid)
            except Exception:       # noqa: BLE001 - state may be broken after a failed step
                log.exception("could not release request %s", rid)
            self._finish(live, dict(reason))

    def _emit(self, changed: list[Request]) -> None:
        for req in changed:
            live = self._live.get(req.rid)
            if live is None:
                continue
            if req.finished:
                del self._live[req.rid]
                self._finish(live, req.finish_reason)
            elif live.stream:
                self._send(live, self._output(live))

    def _finish(self, live: _Live, reason: dict) -> None:
        """Last output of a request: the remaining ids and text, the full meta_info."""
        req = live.req
        req.finish_reason = reason
        out = self._output(live, final=True)
        with self._cv:
            self._known.discard(req.rid)
        self._send(live, out)

    def _output(self, live: _Live, final: bool = False) -> StreamOutput:
        req = live.req
        ids = req.output_ids[live.sent_ids:]
        lps = req.output_logprobs[live.sent_logprobs:]
        tops = req.output_top_logprobs[live.sent_logprobs:]
        live.sent_ids, live.sent_logprobs = len(req.output_ids), len(req.output_logprobs)
        prompt = prompt_tops = None
        if req.logprob_start_len >= 0 and not live.sent_prompt and (final or ids):
            prompt, prompt_tops = list(req.prompt_logprobs), list(req.prompt_top_logprobs)
            live.sent_prompt = True
        if final:
            full = req.text          # set by the scheduler when it retires the request
            if not full and req.output_ids and self._detokenize is not None \
                    and not isinstance(req.finish_reason.get("matched"), str):
                full = self._detokenize(req.output_ids)     # never retired: a failed step
            text = live.detok.finish(full) if live.detok is not None else full
            meta = req.meta_info(self._speculative)
        else:
            text = live.detok.step(req.output_ids) if live.detok is not None else ""
            meta = {"id": req.rid, "prompt_tokens": len(req.prompt_ids),
                    "completion_tokens": len(req.output_ids), "finish_reason": None}
        return StreamOutput(rid=req.rid, token_ids=ids, text=text, logprobs=lps, meta_info=meta,
                            finish_reason=req.finish_reason if final else None,
                            accept_lengths=self._new_accepts(live),
                            verify_widths=self._new_widths(live), time=time.monotonic(),
                            top_logprobs=tops, prompt_logprobs=prompt,
                            prompt_top_logprobs=prompt_tops)

    @staticmethod
    def _new_accepts(live: _Live) -> list[int]:
        """Tokens committed by each verify since the last output."""
        out, live.histogram = _new_since(live.req.spec_accept_histogram, live.histogram)
        return out

    @staticmethod
    def _new_widths(live: _Live) -> list[int]:
        """The verify width of each step since the last output."""
        out, live.widths = _new_since(live.req.spec_width_histogram, live.widths)
        return out

    def _send(self, live: _Live, out: StreamOutput) -> None:
        self._outbox.append((live, out))


def _new_since(hist: list[int], seen: list[int] | None) -> tuple[list[int], list[int] | None]:
    """From a cumulative histogram (count per value - 1) and the copy taken at the last output:
    the values added since, one per event in value order, and the copy to keep now."""
    if not hist:
        return [], seen
    prev = seen or [0] * len(hist)
    return [v + 1 for v, (n, m) in enumerate(zip(hist, prev)) for _ in range(n - m)], list(hist)
