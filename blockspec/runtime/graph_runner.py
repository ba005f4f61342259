"""CUDA graphs of whole steps: capture once per (step kind, sampling mode, padded batch size),
replay afterwards.

A step is a pure function of the static step inputs and the caches (``runtime.metadata``), so
capturing it records every kernel of the forward(s), the sampler and, for speculative steps,
acceptance and commit. Batches are padded to the next captured size with rows that point at
the memory manager's dummy slot. Graphs are captured lazily, the first time a key is needed
(``ModelRunner.ensure_graph`` then also captures the smaller sizes the batch can shrink into),
and share one memory pool (they never run concurrently, and each step's outputs are copied out
behind it, on the same stream, before the next replay can overwrite them).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

log = logging.getLogger("blockspec")


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 32, every 16 up to 256 (sglang's spacing), capped."""
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, 257, 16))
    out = [s for s in sizes if s <= max_bs]
    if not out or out[-1] != max_bs:
        out.append(max_bs)
    return out


class GraphRunner:
    def __init__(self, device: torch.device, max_bs: int, sizes: list[int] | None = None) -> None:
        """Graphs for batches up to ``max_bs``, at ``sizes`` (default ``capture_sizes``; the
        prefill graphs pass their chunk buckets)."""
        self.device = device
        self.sizes = sizes if sizes is not None else capture_sizes(max_bs)
        self.max_bs = max_bs
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = None

    def padded_size(self, bs: int) -> int | None:
        """The captured size a batch of ``bs`` runs at, or None above the largest (eager)."""
        for s in self.sizes:
            if s >= bs:
                return s
        return None

    def has(self, key: Hashable) -> bool:
        return key in self._graphs

    def capture(self, key: Hashable, fn: Callable[[], object]) -> None:
        """Warm ``fn`` up on a side stream (first-call allocations, kernel compilation), then
        record it. The caller has filled the inputs with dummy rows, so neither run touches a
        real request's cache."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        self._graphs[key] = (graph, out)
        log.info("captured CUDA graph %s", key)

    def output(self, key: Hashable) -> object:
        """The captured step's static output (what each replay overwrites)."""
        return self._graphs[key][1]

    def replay(self, key: Hashable) -> torch.Tensor:
        graph, out = self._graphs[key]
        graph.replay()
        return out
