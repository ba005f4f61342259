"""``blockspec bench --steady-state R``: a server's batch rather than one that starts and ends
together. R x B requests are queued at once and at most B run: each finished request is
replaced from the queue at the next step, and output lengths vary (uniform in [L/2, 3L/2]) so
the requests do not finish in waves. The batch then never drains, which a batch that finishes
together does: its tail (the requests still running after the others finished) favours
narrower verify widths, while a server's steady state does not have one.

The rate is every token after each request's first over the run's wall time, the prefills of
the replacements included (they interleave with the decode steps, as in a server).

A cap on running requests (``Scheduler.max_running``) rather than the prefix bench's closed
loop of clients (``prefix_bench.agentic``): a saturated server has requests waiting, so a
replacement joins at the very next step, while a closed-loop client sends its next request
only after it has read the last answer, and those gaps would count against the batch."""
from __future__ import annotations

import argparse
import statistics

import torch

from blockspec.bench.stats import percentile
from blockspec.bench.timing import timed_generate


def steady_workload(batch: int, rounds: int, input_len: int, output_len: int,
                    vocab: int) -> tuple[list[list[int]], list[int]]:
    """The ``rounds`` x ``batch`` prompts and their output lengths (seeded by the batch size,
    as the fixed-batch bench's prompts are)."""
    g = torch.Generator().manual_seed(batch)
    n = rounds * batch
    prompts = [torch.randint(3, vocab, (input_len,), generator=g).tolist() for _ in range(n)]
    lo, hi = max(1, output_len // 2), max(1, output_len * 3 // 2)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return prompts, lens


def measure_steady(engine, batch: int, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """The median of ``args.repeats`` runs of the steady workload at ``batch`` running
    requests, after one warm-up run; returns the row and the median run's outputs."""
    prompts, lens = steady_workload(batch, args.steady_state, args.input_len, args.output_len,
                                    engine.config.vocab_size)
    params = [{"max_new_tokens": n, "temperature": args.temperature, "ignore_eos": True}
              for n in lens]
    engine.scheduler.max_running = batch
    try:
        timed_generate(engine, prompts, params)         # warm-up: allocations, graph capture
        runs = sorted((timed_generate(engine, prompts, params) for _ in range(args.repeats)),
                      key=lambda r: r[0])
    finally:
        engine.scheduler.max_running = None
    wall, outs = runs[len(runs) // 2]
    new_tokens = sum(len(o["output_ids"]) for o in outs) - len(outs)
    ttft = [o["meta_info"]["ttft"] for o in outs]
    e2e = [o["meta_info"]["e2e_latency"] for o in outs]
    row = {"batch_size": batch, "steady_state_requests": len(outs),
           "mean_output_len": round(statistics.mean(len(o["output_ids"]) for o in outs), 1),
           "wall_s": round(wall, 4),
           "decode_tok_per_s": round(new_tokens / wall, 2),
           "tok_per_s_per_seq": round(new_tokens / wall / batch, 2),
           "ttft_p50_s": round(percentile(ttft, 50), 4),      # queue wait included
           "e2e_latency_p50_s": round(percentile(e2e, 50), 4)}
    return row, outs
