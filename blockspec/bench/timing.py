"""Timing GPU work as it runs in serving: inside a CUDA graph, so launch gaps count as they do
in a captured step and the host's launch cost does not."""
from __future__ import annotations

import statistics
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
