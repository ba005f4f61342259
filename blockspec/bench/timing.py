"""Timing device work: inside a CUDA graph (``graph_time_ms``), as it runs in a captured step,
so launch gaps count as they do there and the host's launch cost does not; call by call
(``event_time_ms``), as eager prefill work runs; or a whole ``generate`` call by wall time
between device syncs (``timed_generate``), as the benches time requests."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def graph_time_ms(fn: Callable[[], object], calls: int, reps: int) -> float:
    """Median ms per call: ``calls`` calls captured in one CUDA graph, replayed ``reps`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def event_time_ms(fn: Callable[[], object], reps: int, device: torch.device,
                  warmup: int = 3) -> float:
    """Median ms of ``reps`` calls of ``fn`` after ``warmup``: CUDA events around each call on
    CUDA, wall time elsewhere (where the ops are synchronous)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(engine, prompts: list[list[int]], params) -> tuple[float, list[dict]]:
    """Seconds of one ``engine.generate`` over ``prompts`` (the device idle before and after)
    and its outputs."""
    sync_device(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    sync_device(engine.device)
    return time.perf_counter() - t0, outs
