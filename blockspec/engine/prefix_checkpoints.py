"""The scheduler's side of the prefix cache (cache/prefix_cache.py): which cached prefix a
request resumes from, where prefill chunks end so the Mamba state can be saved, and the
checkpoint a finished request leaves for the next turn of its conversation.

A finished request's committed tokens (prompt + output, less the last token, whose KV is not
written) are cached up to their last page boundary. Its slot's Mamba state has run past that
boundary (and a step in flight may have advanced it further), so the tokens after its last
snapshot are prefilled once more from that snapshot, in its own pages (``seal``); only then is
the state at the boundary known. That costs one prefill of the answer per finished request;
on a model without Mamba layers the pages are cached as they are.
"""
from __future__ import annotations

import logging

from blockspec.cache import MemoryManager
from blockspec.cache.prefix_cache import Hit
from blockspec.engine.request import Request
from blockspec.runtime.model_runner import ModelRunner

log = logging.getLogger("blockspec")


def hit_for(memory: MemoryManager, req: Request) -> Hit | None:
    """The cached prefix ``req`` resumes from. Prompt logprobs need every prompt row's logits
    and a request computed again after a failed step trusts nothing cached: both start at 0."""
    if memory.prefix is None or req.logprob_start_len >= 0 or req.failed_steps > 0:
        return None
    return memory.lookup(req.context_ids)


def admitted(memory: MemoryManager, req: Request, hit: Hit | None) -> None:
    """Book an admission: resume at the hit, count the lookup (first admission only)."""
    req.num_cached = req.cache.cached
    if req.cached_tokens is None:
        req.cached_tokens = min(req.cache.cached, len(req.prompt_ids))
        if memory.prefix is not None:
            memory.prefix.count(len(req.prompt_ids), req.cached_tokens)


def chunk_end(memory: MemoryManager, start: int, end: int, total: int) -> int:
    return memory.prefix.chunk_end(start, end, total) if memory.prefix is not None else end


def after_chunks(memory: MemoryManager, chunks: list[tuple[Request, int, int]]) -> None:
    """Cache the chunks that ended at a checkpoint (right after their forward)."""
    if memory.prefix is None:
        return
    for req, _, e in chunks:
        ctx = req.context_ids
        if memory.prefix.is_checkpoint(e, len(ctx)):
            memory.checkpoint(req.cache, ctx[:e])


def seal(runner: ModelRunner, memory: MemoryManager, drafter: object, chunk: int,
         finished: list[Request]) -> None:
    """Cache what ``finished`` requests committed (see the module docstring); errors only
    cost the cache these entries."""
    p = memory.prefix
    if p is None:
        return
    jobs = []
    for req in finished:
        if req.cache.slot < 0 or not req.output_ids or (req.finish_reason or {}).get("type") in ("abort", "error"):
            continue
        tokens = req.prompt_ids + req.output_ids[:-1]
        end = min(len(tokens), req.num_cached) // p.page_size * p.page_size
        res = req.cache
        start = res.nodes[-1].depth if res.nodes else 0
        if end <= start:
            continue
        if p.snapshots is None:                  # attention only: the pages are the state
            memory.checkpoint(res, tokens[:end])
            continue
        if res.nodes and res.nodes[-1].snapshot is None:
            continue
        if res.nodes:
            p.snapshots.restore(res.nodes[-1].snapshot, res.slot)
        else:
            memory.mamba.reset(res.slot)
        jobs.append([req, tokens[:end], start])
    try:
        while jobs:
            budget, batch = chunk, []
            for job in jobs:
                if budget <= 0:
                    break
                _, toks, pos = job
                # the next turn's context is longer than ``toks``: its end is a checkpoint
                e = p.chunk_end(pos, min(len(toks), pos + budget), len(toks) + 1)
                batch.append((job, pos, e))
                budget -= e - pos
            out, rows = runner.extend([j[0].cache.slot for j, _, _ in batch], [s for _, s, _ in batch],
                                      [j[1][s:e] for j, s, e in batch])
            if drafter is not None:
                drafter.on_prefill(out.aux_hidden, rows)
            for job, _, e in batch:
                job[2] = e
                if p.is_checkpoint(e, len(job[1]) + 1):
                    memory.checkpoint(job[0].cache, job[1][:e])
            jobs = [j for j in jobs if j[2] < len(j[1])]
    except Exception:       # the requests are done: only their cache entries are lost
        log.exception("caching finished requests' prefixes failed")
