"""Data parallelism: ``--dp-size`` engine replicas behind one server.

Each replica is a whole ``Engine`` (its own model copy, cache and loop thread; on CUDA its own
device, ``cuda:i``). ``DataParallelEngine`` has the part of the Engine interface the server
uses (submit, abort, stats, config, tokenizer, ...), so the HTTP layer does not know how many
replicas there are. Each request goes to one replica, chosen by the router:

* **cache-aware** (when the replicas run the prefix cache): the router remembers, per replica,
  hashes of the page-aligned prefixes it sent there (a bounded LRU). A prompt whose longest
  remembered prefix is at least ``MIN_SHARED_TOKENS`` goes to that replica, unless that
  replica is ``LOAD_SLACK`` requests busier than the least loaded one;
* **load-aware** otherwise: the replica with the fewest requests in flight (submitted and not
  yet finished, counted by the router itself, so a burst spreads before any step has run).

The router reads only what it sent (never a replica's cache, which its loop thread owns)."""
from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from blockspec.engine.engine import Engine, GenerateError, resolve_device
from blockspec.engine.loop import LoopStats, StreamOutput
from blockspec.sampling import SamplingParams

MIN_SHARED_TOKENS = 256     # a remembered prefix this long sends a prompt to its replica
LOAD_SLACK = 4              # ... unless that replica has this many more requests in flight
PREFIXES_PER_REPLICA = 65536  # remembered prefix hashes per replica (LRU)
HASH_PAGE = 64              # tokens per hashed block


def prefix_hashes(tokens: list[int], page: int = HASH_PAGE) -> list[int]:
    """A chained hash per whole ``page`` of ``tokens``: entry i names tokens[:(i + 1) * page]."""
    out, h = [], 0
    for i in range(len(tokens) // page):
        h = hash((h, tuple(tokens[i * page:(i + 1) * page])))
        out.append(h)
    return out


class Router:
    """Picks a replica per request (see the module docstring); thread-safe."""

    def __init__(self, replicas: int, cache_aware: bool, page: int = HASH_PAGE,
                 capacity: int = PREFIXES_PER_REPLICA) -> None:
        self.page, self.capacity, self.cache_aware = page, capacity, cache_aware
        self.in_flight = [0] * replicas
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self._lock = threading.Lock()

    def pick(self, tokens: list[int]) -> int:
        """The replica for ``tokens``; counts the request in flight there."""
        hashes = prefix_hashes(tokens, self.page) if self.cache_aware else []
        with self._lock:
            least = min(range(len(self.in_flight)), key=lambda r: (self.in_flight[r], r))
            best, shared = least, 0
            for r, seen in enumerate(self._seen):
                n = 0
                while n < len(hashes) and hashes[n] in seen:
                    n += 1
                if n * self.page > shared:
                    best, shared = r, n * self.page
            if shared < MIN_SHARED_TOKENS or self.in_flight[best] > self.in_flight[least] + LOAD_SLACK:
                best = least
            seen = self._seen[best]
            for h in hashes:
                seen[h] = None
                seen.move_to_end(h)
            while len(seen) > self.capacity:
                seen.popitem(last=False)
            self.in_flight[best] += 1
            return best

    def done(self, replica: int) -> None:
        with self._lock:
            self.in_flight[replica] -= 1


class DataParallelEngine:
    """``len(replicas)`` engines serving one model as one (see the module docstring)."""

    def __init__(self, replicas: list[Engine]) -> None:
        if not replicas:
            raise ValueError("DataParallelEngine needs at least one replica")
        self.replicas = replicas
        self.router = Router(len(replicas), cache_aware=replicas[0].memory.prefix is not None)
        self._where: dict[str, int] = {}          # live request id -> replica
        self._lock = threading.Lock()

    @classmethod
    def build(cls, dp_size: int, **engine_kwargs: Any) -> "DataParallelEngine":
        """``dp_size`` replicas of ``Engine(**engine_kwargs)``; on CUDA replica i on ``cuda:i``
        (an explicit ``cuda:k`` device starts the count at k)."""
        if dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {dp_size}")
        if dp_size > 1 and engine_kwargs.get("tp_size", 1) > 1:
            raise ValueError("--dp-size > 1 with --tp-size > 1 is not supported: the replicas "
                             "share this process, which holds one tensor-parallel group")
        dev = resolve_device(engine_kwargs.get("device") or "auto")
        base = dev.index or 0
        if dev.type == "cuda" and base + dp_size > torch.cuda.device_count():
            # refused before any replica loads a model
            raise ValueError(f"--dp-size {dp_size} needs GPUs cuda:{base}..cuda:"
                             f"{base + dp_size - 1}, but {torch.cuda.device_count()} are visible")
        replicas: list[Engine] = []
        try:
            for i in range(dp_size):
                kw = dict(engine_kwargs)
                if dev.type == "cuda":
                    kw["device"] = f"cuda:{base + i}"
                replicas.append(Engine(**kw))
        except BaseException:
            for e in replicas:
                e.shutdown()
            raise
        return cls(replicas)

    # ---- what the server reads ---------------------------------------------------------------
    @property
    def args(self):
        return self.replicas[0].args

    @property
    def config(self):
        return self.replicas[0].config

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def context_length(self) -> int:
        return min(e.context_length for e in self.replicas)

    @property
    def verify_width(self) -> int:
        return self.replicas[0].verify_width

    def compile_grammar(self, params: SamplingParams):
        return self.replicas[0].compile_grammar(params)

    def stats(self) -> LoopStats:
        """The replicas' stats summed (cache usage: their mean; alive: all of them)."""
        parts = [e.stats() for e in self.replicas]
        total = LoopStats(alive=all(s.alive for s in parts))
        for name in ("waiting", "running", "prefix_queried", "prefix_hits", "prefix_pages",
                     "steps"):
            total = replace(total, **{name: sum(getattr(s, name) for s in parts)})
        return replace(total, cache_usage=sum(s.cache_usage for s in parts) / len(parts))

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, input_ids: list[int], params: SamplingParams,
               sink: Callable[[StreamOutput], None], *, rid: str | None = None,
               **kw: Any) -> str:
        """``Engine.submit`` on the router's replica; the request's outputs go to ``sink``."""
        rid = rid if rid is not None else uuid.uuid4().hex
        r = self.router.pick(list(input_ids))
        with self._lock:
            if rid in self._where:
                self.router.done(r)
                raise GenerateError(f"request id {rid!r} is already in use", "rid")
            self._where[rid] = r       # before submitting: its first output may come at once

        def routed_sink(out: StreamOutput) -> None:
            if out.finished:
                self._forget(out.rid)
            sink(out)
        try:
            return self.replicas[r].submit(input_ids, params, routed_sink, rid=rid, **kw)
        except BaseException:
            self._forget(rid)
            raise

    def _forget(self, rid: str) -> None:
        with self._lock:
            r = self._where.pop(rid, None)
        if r is not None:
            self.router.done(r)

    def abort(self, rid: str, wait: float | None = None) -> bool:
        with self._lock:
            r = self._where.get(rid)
        return self.replicas[r].abort(rid, wait) if r is not None else False

    def shutdown(self) -> None:
        for e in self.replicas:
            e.shutdown()

    def __enter__(self) -> "DataParallelEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
