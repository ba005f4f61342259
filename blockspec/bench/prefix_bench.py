"""Prefix cache benchmark: the same token sequences with the cache on and off.

    blockspec bench --prefix-cache --workload multi-turn --batch-size 1,16 --input-len 32768
        --turns 8 --output-len 256 [--preset P --quantized ...]
    blockspec bench --prefix-cache --workload agentic --input-len 65536 --suffix-len 1024
        --output-len 400 --num-requests 32 --concurrency 1,16

Order: the engine is built with the cache on and every batch size / concurrency runs on it;
then it is shut down and freed (``torch.cuda.empty_cache()`` on CUDA), built again with the
cache off, and the same sequences run. Each engine first serves two warm-up requests on
unrelated tokens in the workload's shapes, the second resuming from the first (kernels
compiled and graphs captured for both a cold and a resumed prefill, before any timing).
Tokens are random, seeded, greedy, EOS ignored; every request's timing comes from its outputs' loop times (``StreamOutput.time``),
the device synchronized before each submission.

multi-turn: ``--batch-size`` conversations at once, ``--turns`` turns. Turn t's prompt is
every earlier turn's user tokens and answer, then a fresh random user message; the user
messages are sized so the last turn's prompt is ``--input-len`` tokens. The cache-on run's
answers (the engine's output ids) are recorded and replayed as history in the cache-off run,
so both prefill exactly the same prompts; the cache-off run's own answers are compared with
the recorded ones (``outputs_match``). TTFT is submit to first token, per turn the mean over
the conversations.

agentic: one ``--input-len`` shared prefix, ``--num-requests`` requests each with a distinct
``--suffix-len`` suffix. The first request runs alone (it fills the cache as an agent's system
prompt would, and counts in the statistics); the rest run in a closed loop keeping
``--concurrency`` in flight. Request time is submit to finish. A hit lands where the first
request's prefill saved a Mamba checkpoint: at a prefill chunk's end (chunks end at multiples of
``--mamba-track-interval``), so ``--chunked-prefill-size`` should divide ``--input-len``.
"""
from __future__ import annotations

import argparse
import gc
import json
import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from blockspec.bench.bench_args import with_lengths
from blockspec.bench.engine_bench import build_engine
from blockspec.bench.jsonl import append_rows
from blockspec.bench.prefill_bench import _prompt
from blockspec.bench.stats import percentile
from blockspec.bench.timing import sync_device
from blockspec.sampling import SamplingParams

_TIMEOUT_S = 3600.0
WARMUP_PREFIX = 16384  # agentic warm-up: the shared prefix (two default prefill chunks)


class _Tracker:
    """Per-request submit / first-token / finish times, output ids and cached tokens, filled
    from the engine loop's thread; finished request ids are queued for the closed loop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.submit: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.end: dict[str, float] = {}
        self.ids: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.done: queue.Queue[str] = queue.Queue()

    def start(self, engine, rid: str, prompt: list[int], output_len: int) -> None:
        self.ids[rid] = []
        sync_device(engine.device)
        self.submit[rid] = time.monotonic()
        params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        engine.submit(prompt, params, self._sink(rid), rid=rid)

    def _sink(self, rid: str):
        def sink(out) -> None:
            with self.lock:
                if out.token_ids:
                    self.first.setdefault(rid, out.time)
                    self.ids[rid].extend(out.token_ids)
                if out.finish_reason is not None:
                    if out.finish_reason.get("type") in ("abort", "error"):
                        self.ids[rid] = []
                    self.end[rid] = out.time
                    self.cached[rid] = int(out.meta_info.get("cached_tokens") or 0)
                    self.done.put(rid)
        return sink

    def wait_one(self) -> str:
        return self.done.get(timeout=_TIMEOUT_S)

    def ttft(self, rid: str) -> float:
        return self.first[rid] - self.submit[rid]

    def latency(self, rid: str) -> float:
        return self.end[rid] - self.submit[rid]


def _check(tr: _Tracker, rid: str, output_len: int) -> None:
    if len(tr.ids[rid]) != output_len:
        raise RuntimeError(f"prefix bench: request {rid} ended with {len(tr.ids[rid])} of "
                           f"{output_len} tokens (aborted or failed; see the engine's log)")


def user_len(input_len: int, turns: int, output_len: int) -> int:
    """User tokens per turn so the last turn's prompt is about ``input_len`` tokens:
    turns x user + (turns - 1) x output_len."""
    n = (input_len - (turns - 1) * output_len) // turns
    if n < 1:
        raise ValueError(f"--input-len {input_len} is too short for --turns {turns} answers of "
                         f"--output-len {output_len}")
    return n


def multi_turn(engine, batch: int, turns: int, ulen: int, output_len: int,
               answers: list[list[list[int]]] | None) -> tuple[dict, list[list[list[int]]]]:
    """One multi-turn run of ``batch`` conversations. With ``answers`` (the cache-on run's,
    [conversation][turn]) they are the history; without, the engine's own answers are. Returns
    the row's figures and the answers this run generated."""
    vocab = engine.config.vocab_size
    history: list[list[int]] = [[] for _ in range(batch)]
    got: list[list[list[int]]] = [[] for _ in range(batch)]
    ttft, cached, prompt_lens = [], [], []
    t0 = time.perf_counter()
    for t in range(turns):
        tr = _Tracker()
        rids = []
        for c in range(batch):
            history[c] = history[c] + _prompt(vocab, ulen, seed=10_000 * (batch + 1) + 100 * c + t)
            rid = f"conv{batch}-{c}-turn{t}"
            tr.start(engine, rid, history[c], output_len)
            rids.append(rid)
        for _ in rids:
            tr.wait_one()
        sync_device(engine.device)
        for c, rid in enumerate(rids):
            _check(tr, rid, output_len)
            got[c].append(tr.ids[rid])
            history[c] = history[c] + (answers[c][t] if answers is not None else tr.ids[rid])
        prompt_lens.append(len(history[0]) - output_len)
        ttft.append(statistics.mean(tr.ttft(r) for r in rids))
        cached.append(statistics.mean(tr.cached[r] for r in rids))
    wall = time.perf_counter() - t0
    row = {"prompt_len_per_turn": prompt_lens, "ttft_s_per_turn": ttft,
           "last_turn_ttft_s": ttft[-1], "cached_tokens_per_turn": cached, "wall_s": wall}
    return row, got


def agentic(engine, prompts: list[list[int]], concurrency: int, output_len: int,
            tag: str) -> tuple[dict, list[list[int]]]:
    """The first prompt alone, then the rest in a closed loop of ``concurrency`` in flight."""
    tr = _Tracker()
    rids = [f"agent{tag}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    tr.start(engine, rids[0], prompts[0], output_len)
    tr.wait_one()
    nxt, live = 1, 0
    while nxt < len(prompts) and live < concurrency:
        tr.start(engine, rids[nxt], prompts[nxt], output_len)
        nxt, live = nxt + 1, live + 1
    while live:
        tr.wait_one()
        live -= 1
        if nxt < len(prompts):
            tr.start(engine, rids[nxt], prompts[nxt], output_len)
            nxt, live = nxt + 1, live + 1
    sync_device(engine.device)
    wall = time.perf_counter() - t0
    for rid in rids:
        _check(tr, rid, output_len)
    lat = [tr.latency(r) for r in rids]
    row = {"request_time_s": {"mean": statistics.mean(lat), "p50": percentile(lat, 50),
                              "p99": percentile(lat, 99)},
           "mean_ttft_s": statistics.mean(tr.ttft(r) for r in rids), "wall_s": wall,
           "cached_tokens": sum(tr.cached[r] for r in rids),
           "cached_tokens_per_request": [tr.cached[r] for r in rids]}
    return row, [tr.ids[r] for r in rids]


def _lengths(args: argparse.Namespace) -> tuple[int, int]:
    """--input-len (one) and --output-len, with this bench's defaults when not given."""
    multi = args.workload == "multi-turn"
    args = with_lengths(args, 32768 if multi else 65536, 256 if multi else 400)
    if len(args.input_len) != 1:
        raise ValueError("--prefix-cache takes one --input-len")
    return args.input_len[0], int(args.output_len)


def _cache_kw(args: argparse.Namespace, on: bool) -> dict:
    kw = {"enable_radix_cache": True} if on else {"disable_radix_cache": True}
    for name in ("page_size", "mamba_track_interval", "mamba_cache_slots"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    return kw


def _free(engine) -> None:
    device = engine.device
    engine.shutdown()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _base(engine, label: str, args: argparse.Namespace, on: bool) -> dict:
    return {"bench": "prefix_cache", "workload": args.workload, "model": label,
            "device": torch.cuda.get_device_name(engine.device)
            if engine.device.type == "cuda" else "cpu",
            "dtype": str(engine.dtype).split(".")[-1], "quantized": bool(args.quantized),
            "speculative": type(engine.drafter.draft).__name__ if engine.drafter else None,
            "random_draft": getattr(args, "random_draft", None),
            "simulated_accept_profile": getattr(args, "simulate_accept_profile", None),
            "radix_cache": on, "page_size": engine.args.page_size,
            "mamba_track_interval": engine.args.mamba_track_interval}


def _warm_up(engine, first: int, then: int, output_len: int, *, follow: bool) -> None:
    """Two requests on unrelated tokens in the workload's shapes, so the timed runs compile no
    kernel and capture no graph: ``first`` tokens, then a second request that resumes from the
    first (``follow``: its whole prompt and answer, as a next turn does; else a shared prefix
    of ``first`` tokens, as an agent's next call does) and adds ``then`` new tokens."""
    vocab, sp = engine.config.vocab_size, {"max_new_tokens": output_len, "temperature": 0.0,
                                           "ignore_eos": True}
    one = _prompt(vocab, first, seed=7)
    out = engine.generate(input_ids=[one], sampling_params=sp)[0]["output_ids"]
    two = (one + out if follow else one) + _prompt(vocab, then, seed=8)
    engine.generate(input_ids=[two], sampling_params=sp)
    sync_device(engine.device)


def _emit(rows: list[dict], row: dict) -> None:
    print(json.dumps(row), flush=True)
    rows.append(row)


def _cache_on_off(args: argparse.Namespace, ns: argparse.Namespace, levels: list[int],
                  warm_up: Callable[[Any], None],
                  one: Callable[[Any, int, int, Any], tuple[dict, Any]]) -> tuple[list, dict]:
    """The engine with the cache on, then (freed) with it off, each warmed up and run at every
    level: ``one(engine, k, level, got)`` -> (row figures, what the run generated), ``got``
    being the cache-on run's at that level in the cache-off run (None before). Returns the
    rows in order and them by (level, on); cache-off rows carry ``outputs_match``."""
    rows: list[dict] = []
    got_on: dict[int, Any] = {}
    by_key: dict[tuple[int, bool], dict] = {}
    for on in (True, False):
        engine, label = build_engine(ns, max(levels), **_cache_kw(args, on))
        try:
            warm_up(engine)
            for k, level in enumerate(levels):
                fig, got = one(engine, k, level, None if on else got_on[level])
                row = {**_base(engine, label, args, on), **fig}
                if on:
                    got_on[level] = got
                else:
                    row["outputs_match"] = got == got_on[level]
                by_key[(level, on)] = row
                _emit(rows, row)
        finally:
            _free(engine)
    return rows, by_key


def _ratio(workload: str, on: dict, off: dict, **fields: Any) -> dict:
    return {"bench": "prefix_cache", "workload": workload, "ratio": "cache_on/off", **fields,
            "wall_ratio": on["wall_s"] / off["wall_s"], "outputs_match": off["outputs_match"]}


def _run_multi_turn(args: argparse.Namespace, input_len: int, output_len: int) -> list[dict]:
    batches = args.batch_size if isinstance(args.batch_size, list) else [args.batch_size]
    turns = args.turns
    ulen = user_len(input_len, turns, output_len)
    ns = argparse.Namespace(**{**vars(args), "input_len": input_len, "output_len": output_len})

    def one(engine, _k: int, b: int, answers) -> tuple[dict, Any]:
        # the cache-off run replays the cache-on run's answers as history
        fig, got = multi_turn(engine, b, turns, ulen, output_len, answers)
        return {"batch_size": b, "turns": turns, "input_len": input_len, "user_len": ulen,
                "output_len": output_len, **fig}, got

    rows, by_key = _cache_on_off(
        args, ns, batches, lambda e: _warm_up(e, ulen, ulen, output_len, follow=True), one)
    for b in batches:
        w, wo = by_key[(b, True)], by_key[(b, False)]
        _emit(rows, _ratio("multi-turn", w, wo, batch_size=b, turns=turns, input_len=input_len,
                           last_turn_ttft_ratio=w["last_turn_ttft_s"] / wo["last_turn_ttft_s"],
                           ttft_ratio_per_turn=[a / c for a, c in zip(w["ttft_s_per_turn"],
                                                                      wo["ttft_s_per_turn"])]))
    return rows


def _run_agentic(args: argparse.Namespace, input_len: int, output_len: int) -> list[dict]:
    levels = args.concurrency if isinstance(args.concurrency, list) else [args.concurrency]
    n, slen = args.num_requests, args.suffix_len
    if n < 1 or slen < 1:
        raise ValueError("--num-requests and --suffix-len must be >= 1")
    ns = argparse.Namespace(**{**vars(args), "input_len": input_len + slen,
                               "output_len": output_len})

    def one(engine, k: int, c: int, cached_run) -> tuple[dict, Any]:
        vocab = engine.config.vocab_size
        # a prefix per level: a later level must not hit an earlier level's prefix
        prefix = _prompt(vocab, input_len, seed=50_000 + k)
        prompts = [prefix + _prompt(vocab, slen, seed=60_000 + 1000 * k + i) for i in range(n)]
        fig, got = agentic(engine, prompts, c, output_len, tag=f"{k}-{int(cached_run is None)}")
        return {"concurrency": c, "num_requests": n, "input_len": input_len, "suffix_len": slen,
                "output_len": output_len, **fig}, got

    rows, by_key = _cache_on_off(
        args, ns, levels,
        lambda e: _warm_up(e, min(input_len, WARMUP_PREFIX), slen, output_len, follow=False), one)
    for c in levels:
        w, wo = by_key[(c, True)], by_key[(c, False)]
        _emit(rows, _ratio("agentic", w, wo, concurrency=c, num_requests=n, input_len=input_len,
                           mean_request_time_ratio=w["request_time_s"]["mean"]
                           / wo["request_time_s"]["mean"],
                           mean_ttft_ratio=w["mean_ttft_s"] / wo["mean_ttft_s"]))
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    """Every row: one per (workload level, cache on / off), then one ratio row per level."""
    input_len, output_len = _lengths(args)
    if args.workload == "multi-turn":
        return _run_multi_turn(args, input_len, output_len)
    return _run_agentic(args, input_len, output_len)


def main(args: argparse.Namespace) -> int:
    rows = run(args)
    append_rows(args.out, rows)
    return 0
