"""Inter-token latency of running streams while a long prompt prefills.

    blockspec bench --itl-under-prefill --batch-size 16 --input-len 32768
        [--decoding-prefill-chunk-size 256,512,1024] [--preset P ...]

A prefill forward that runs between two decode steps delays every running stream by its
duration, so how a scheduler shares steps between a long prompt and the streams already
decoding shows up as their inter-token latency (ITL) while that prompt is prefilled.

One engine, warmed up (a long prefill and a decode run, so kernels are compiled and graphs
captured). Then ``--batch-size`` streams (``STREAM_PROMPT`` -token prompts, greedy, EOS
ignored) decode; once each has ``STEADY_AFTER`` tokens, their gaps for the next
``STEADY_TOKENS`` tokens give the steady ITL. The long prompt (``--input-len``, one new token)
is then submitted; every stream gap that ends between its submission and its first token is
a gap *during* the prefill. ITL is a gap over the tokens it delivered (a verify may deliver
several). The streams are aborted at the end. Each ``--decoding-prefill-chunk-size`` value
is one such run (one row) on the same engine.
"""
from __future__ import annotations

import argparse
import itertools
import json
import threading
import time

import torch

from blockspec.bench.bench_args import with_lengths
from blockspec.bench.engine_bench import build_engine
from blockspec.bench.jsonl import append_rows
from blockspec.bench.prefill_bench import _prompt
from blockspec.bench.stats import percentile
from blockspec.bench.timing import sync_device
from blockspec.sampling import SamplingParams

STREAM_PROMPT = 128
STEADY_AFTER = 16
STEADY_TOKENS = 48
_POLL_S = 0.002


class _Recorder:
    """Per-request (time, tokens) of every output, filled from the engine loop's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: dict[str, list[tuple[float, int]]] = {}
        self.finished: set[str] = set()

    def sink_for(self, rid: str):
        self.events[rid] = []

        def sink(out) -> None:
            with self.lock:
                if out.token_ids:
                    self.events[rid].append((out.time, len(out.token_ids)))
                if out.finish_reason is not None:
                    self.finished.add(rid)
        return sink

    def count(self, rid: str) -> int:
        with self.lock:
            return sum(n for _, n in self.events[rid])

    def first_time(self, rid: str) -> float | None:
        with self.lock:
            ev = self.events[rid]
            return ev[0][0] if ev else None


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"itl bench: timed out waiting for {what}")
        time.sleep(_POLL_S)


def gaps(events: list[tuple[float, int]], lo: float, hi: float) -> list[float]:
    """Per-token ITLs of the gaps that end in (lo, hi]: gap / tokens delivered at its end."""
    out = []
    for (t0, _), (t1, n) in itertools.pairwise(events):
        if lo < t1 <= hi:
            out.append((t1 - t0) / n)
    return out


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": percentile(xs, 50) * 1e3, "p99_ms": percentile(xs, 99) * 1e3,
            "max_ms": max(xs) * 1e3 if xs else float("nan")}


def run(args: argparse.Namespace) -> list[dict]:
    args = with_lengths(args)
    batches = args.batch_size if isinstance(args.batch_size, list) else [args.batch_size]
    lens = args.input_len if isinstance(args.input_len, list) else [args.input_len]
    if len(batches) != 1 or len(lens) != 1:
        raise ValueError("--itl-under-prefill takes one --batch-size (the running streams) and "
                         "one --input-len (the long prompt)")
    streams, long_len = batches[0], lens[0]
    ns = argparse.Namespace(**{**vars(args), "input_len": long_len})
    engine, label = build_engine(ns, streams + 1)
    vocab = engine.config.vocab_size
    greedy = {"temperature": 0.0, "ignore_eos": True}
    chunks = getattr(args, "decoding_prefill_chunk_size", None) or [engine.scheduler.decoding_chunk]
    base = {
        "bench": "itl_under_prefill", "model": label,
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
        "dtype": str(engine.dtype).split(".")[-1], "quantized": bool(args.quantized),
        "speculative": type(engine.drafter.draft).__name__ if engine.drafter else None,
        "streams": streams, "stream_prompt_len": STREAM_PROMPT, "input_len": long_len,
        "chunked_prefill_size": engine.scheduler.chunk,
    }
    try:
        engine.generate(input_ids=[_prompt(vocab, long_len, seed=1)],
                        sampling_params={**greedy, "max_new_tokens": 1})
        engine.generate(input_ids=[_prompt(vocab, STREAM_PROMPT, seed=2 + i) for i in range(streams)],
                        sampling_params={**greedy, "max_new_tokens": 8})
        sync_device(engine.device)
        rows = []
        for n, chunk in enumerate(chunks):
            engine.scheduler.decoding_chunk = min(chunk, engine.scheduler.chunk)
            row = {**base, "decoding_prefill_chunk_size": engine.scheduler.decoding_chunk,
                   **_one_run(engine, streams, long_len, args.output_len, greedy, seed=1000 * n)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        engine.shutdown()


def _one_run(engine, streams: int, long_len: int, horizon: int, greedy: dict, seed: int) -> dict:
    """Start the streams, take the steady window, prefill the long prompt, abort the streams."""
    vocab = engine.config.vocab_size
    rec = _Recorder()
    params = SamplingParams(max_new_tokens=horizon, **greedy)
    rids = []
    for i in range(streams):
        rid = f"stream-{seed + i}"
        engine.submit(_prompt(vocab, STREAM_PROMPT, seed=seed + 100 + i), params,
                      rec.sink_for(rid), rid=rid)
        rids.append(rid)
    _wait(lambda: all(rec.count(r) >= STEADY_AFTER for r in rids), 600, "the streams to start")
    t_steady = time.monotonic()
    _wait(lambda: all(rec.count(r) >= STEADY_AFTER + STEADY_TOKENS for r in rids), 600,
          "the steady window")
    t_submit = time.monotonic()
    long_rid = f"long-prompt-{seed}"
    engine.submit(_prompt(vocab, long_len, seed=seed + 3), SamplingParams(max_new_tokens=1, **greedy),
                  rec.sink_for(long_rid), rid=long_rid)
    _wait(lambda: rec.first_time(long_rid) is not None, 600, "the long prompt's first token")
    t_first = rec.first_time(long_rid)
    early = any(r in rec.finished for r in rids)
    for r in rids:
        engine.abort(r, wait=60)
    if early:
        raise ValueError(f"--output-len {horizon} is too short: a stream finished before the "
                         f"long prompt's first token; raise it")
    with rec.lock:
        steady = [g for r in rids for g in gaps(rec.events[r], t_steady, t_submit)]
        during = [g for r in rids for g in gaps(rec.events[r], t_submit, t_first)]
    row = {"long_ttft_s": t_first - t_submit, "steady_itl": summary(steady),
           "during_prefill_itl": summary(during)}
    row["p99_during_over_steady_p50"] = row["during_prefill_itl"]["p99_ms"] / row["steady_itl"]["p50_ms"]
    return row


def main(args: argparse.Namespace) -> int:
    rows = run(args)
    append_rows(args.out, rows)
    return 0
