"""The asyncio face of the Engine for the HTTP layer.

An HTTP request becomes a ``Group`` of engine requests (n samples of each prompt) whose outputs
arrive, from the engine loop's thread, on one asyncio queue. The group aborts whatever is still
running when its reader leaves (client disconnect, error), and the client ends every group with
``ServerShuttingDown`` when the server stops, so no stream hangs."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from blockspec.engine.engine import GenerateError
from blockspec.engine.loop import EngineClosedError, StreamOutput
from blockspec.server.errors import APIError
from blockspec.server.metrics import Metrics, RequestTimer
from blockspec.server.validate import Item

log = logging.getLogger("blockspec")

_SHUTDOWN = object()
_GONE = object()
DISCONNECT_POLL_S = 0.5


class ServerShuttingDown(Exception):
    pass


class ClientGone(Exception):
    pass


class Group:
    def __init__(self, client: "EngineClient", base_id: str, rids: list[str]) -> None:
        self.client, self.base_id, self.rids = client, base_id, rids
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.pending = set(rids)
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False

    async def outputs(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                      ) -> AsyncIterator[tuple[int, StreamOutput]]:
        """(choice index, output) until every request has finished. With ``is_disconnected``
        (non-streaming responses, where no write would fail), a watcher polls the client and
        ``ClientGone`` is raised once it has left."""
        watcher = asyncio.create_task(self._watch(is_disconnected)) if is_disconnected else None
        try:
            while self.pending:
                item = await self.queue.get()
                if item is _SHUTDOWN:
                    raise ServerShuttingDown()
                if item is _GONE:
                    raise ClientGone()
                if item.finished:
                    self.pending.discard(item.rid)
                yield self.index[item.rid], item
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _watch(self, is_disconnected: Callable[[], Awaitable[bool]]) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await is_disconnected():
                self.queue.put_nowait(_GONE)
                return

    def close(self) -> None:
        """Abort what is still running (without waiting) and forget the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for rid in list(self.pending):
            self.client.engine.abort(rid)
        self.client.groups.pop(self.base_id, None)


class EngineClient:
    def __init__(self, engine: Any, metrics: Metrics, max_queued_requests: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queued = max_queued_requests
        self.groups: dict[str, Group] = {}
        self.closing: str | None = None       # set: every open group is being ended
        self.draining = False                 # set: new requests are refused, open ones go on

    def submit(self, items: list[Item], *, base_id: str, return_logprob: bool, stream: bool,
               rids: list[str] | None = None, top_logprobs_num: int = 0,
               logprob_start_len: int = -1) -> Group:
        """Queue every item or none (APIError: 503 closing, 429 queue full, 400 refused);
        ``top_logprobs_num`` / ``logprob_start_len`` as for ``Engine.submit``."""
        if self.closing is not None or self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests",
                           code="shutting_down")
        stats = self.engine.stats()
        if not stats.alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        if self.max_queued is not None and stats.waiting + len(items) > self.max_queued:
            raise APIError(429, f"too many queued requests ({stats.waiting} waiting, at most "
                                f"{self.max_queued}); retry later", code="queue_full")
        if base_id in self.groups:
            raise APIError(400, f"request id {base_id!r} is already in use", param="rid")
        if rids is None:
            rids = [base_id] if len(items) == 1 else [f"{base_id}-{i}" for i in range(len(items))]
        group = Group(self, base_id, rids)
        aloop = asyncio.get_running_loop()
        put, metrics = group.queue.put_nowait, self.metrics

        def sink_for(timer: RequestTimer) -> Callable[[StreamOutput], None]:
            def sink(out: StreamOutput) -> None:       # runs on the engine loop's thread
                metrics.observe(timer, out)
                aloop.call_soon_threadsafe(put, out)
            return sink

        done: list[str] = []
        try:
            for rid, item in zip(rids, items):
                self.engine.submit(item.prompt_ids, item.params, sink_for(RequestTimer()),
                                   return_logprob=return_logprob, stream=stream, rid=rid,
                                   group=group, top_logprobs_num=top_logprobs_num,
                                   logprob_start_len=logprob_start_len)
                done.append(rid)
        except (GenerateError, ValueError, EngineClosedError) as e:
            for rid in done:
                self.engine.abort(rid)
            if isinstance(e, EngineClosedError):
                raise APIError(503, "the engine is shut down", code="engine_dead") from None
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        self.groups[base_id] = group
        return group

    async def abort(self, rid: str | None, abort_all: bool = False) -> int:
        """Abort one request id, every request of a group id, or everything; returns how many
        were live. Waits until the engine has freed their cache."""
        if abort_all:
            targets = [r for g in list(self.groups.values()) for r in g.pending]
        elif rid in self.groups:
            targets = list(self.groups[rid].pending)
        else:
            targets = [rid]
        hits = 0
        for r in targets:
            hits += await asyncio.to_thread(self.engine.abort, r, 10.0)
        return hits

    def begin_drain(self) -> None:
        """Refuse new requests (503); the ones already in go on until they finish."""
        self.draining = True

    def begin_shutdown(self, reason: str = "shutting down") -> None:
        """Refuse new requests; end every open group with ServerShuttingDown and abort its
        engine requests. Runs on the event loop."""
        if self.closing is not None:
            return
        self.closing = reason
        for group in list(self.groups.values()):
            group.queue.put_nowait(_SHUTDOWN)
            for rid in list(group.pending):
                self.engine.abort(rid)
