"""Prometheus metrics (GET /metrics), fed from the engine loop's outputs as they reach the
server, plus the loop's own snapshot (queue depth, running requests, cache usage) read at
scrape time. Each app has its own registry, so several servers can live in one process."""
from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from blockspec.engine.loop import LoopStats, StreamOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class RequestTimer:
    """Per engine request: when it was submitted and when its last tokens arrived."""

    __slots__ = ("start", "last", "first_seen")

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.last = self.start
        self.first_seen = False


class Metrics:
    def __init__(self, verify_width: int = 0) -> None:
        disable_created_metrics()        # no *_created series: noise for every scrape
        self.registry = r = CollectorRegistry()
        self.http = Counter("blockspec_http_requests", "HTTP requests by route and status code",
                            ["route", "status"], registry=r)
        self.finished = Counter("blockspec_requests", "engine requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("blockspec_prompt_tokens", "prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("blockspec_generation_tokens", "tokens generated",
                                         registry=r)
        self.queue = Gauge("blockspec_num_queue_reqs", "requests waiting for cache", registry=r)
        self.running = Gauge("blockspec_num_running_reqs", "requests holding cache (prefill or "
                             "decode)", registry=r)
        self.cache_usage = Gauge("blockspec_cache_usage", "fraction of KV cache blocks held",
                                 registry=r)
        # the engine counts; each scrape adds what it counted since the last one
        self.prefix_queried = Counter("blockspec_prefix_cache_queried_tokens", "prompt tokens "
                                      "looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("blockspec_prefix_cache_hit_tokens", "prompt tokens resumed "
                                   "from the prefix cache", registry=r)
        self._prefix_seen = (0, 0)
        self.prefix_pages = Gauge("blockspec_prefix_cache_pages", "KV pages the prefix cache "
                                  "holds", registry=r)
        self.steps = Gauge("blockspec_engine_steps", "forward steps the engine loop has run",
                           registry=r)
        self.ttft = Histogram("blockspec_time_to_first_token_seconds", "submission to first "
                              "token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("blockspec_inter_token_latency_seconds", "time per output token "
                             "after the first (a step's gap split over the tokens it committed)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("blockspec_e2e_request_latency_seconds", "submission to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.verify_width = verify_width
        if verify_width:
            self.accept_length = Histogram(
                "blockspec_spec_accept_length", "tokens committed per speculative verify (bonus "
                "token included)", buckets=tuple(range(1, verify_width + 1)), registry=r)
            self.verifies = Counter("blockspec_spec_verify", "speculative verify steps, per "
                                    "request", registry=r)
            self.accepted_per_pos = Counter(
                "blockspec_spec_accepted_tokens_per_pos", "draft tokens accepted at each block "
                "position (1 = first draft); divide by blockspec_spec_verify_total for the rate",
                ["position"], registry=r)
            for pos in range(1, verify_width):
                self.accepted_per_pos.labels(position=str(pos))
            self.width = Histogram(
                "blockspec_spec_verify_width", "verify width of each speculative step, per "
                "request (1 = plain decoding; --speculative-adaptive chooses it, else it is the "
                "maximum)", buckets=tuple(range(1, verify_width + 1)), registry=r)

    def observe(self, timer: RequestTimer, out: StreamOutput) -> None:
        """Account one engine output of one request."""
        k = len(out.token_ids)
        if k:
            self.generation_tokens.inc(k)
            if not timer.first_seen:
                timer.first_seen = True
                self.ttft.observe(out.time - timer.start)
                k -= 1
                timer.last = out.time
            if k:
                gap = (out.time - timer.last) / k
                for _ in range(k):
                    self.itl.observe(gap)
                timer.last = out.time
        if self.verify_width:
            for a in out.accept_lengths:
                self.accept_length.observe(a)
                self.verifies.inc()
                for pos in range(1, a):
                    self.accepted_per_pos.labels(position=str(pos)).inc()
            for w in out.verify_widths:
                self.width.observe(w)
        if out.finished:
            self.finished.labels(finish_reason=out.finish_reason["type"]).inc()
            self.prompt_tokens.inc(out.meta_info.get("prompt_tokens", 0))
            self.e2e.observe(out.time - timer.start)

    def render(self, stats: LoopStats) -> bytes:
        self.queue.set(stats.waiting)
        self.running.set(stats.running)
        self.cache_usage.set(stats.cache_usage)
        self.steps.set(stats.steps)
        queried, hits = self._prefix_seen
        self.prefix_queried.inc(max(stats.prefix_queried - queried, 0))
        self.prefix_hits.inc(max(stats.prefix_hits - hits, 0))
        self._prefix_seen = (max(stats.prefix_queried, queried), max(stats.prefix_hits, hits))
        self.prefix_pages.set(stats.prefix_pages)
        return generate_latest(self.registry)
