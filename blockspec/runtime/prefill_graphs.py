"""Prefill chunks of one request replayed from CUDA graphs.

An eager prefill forward issues a few thousand kernel launches from Python, tens of
milliseconds of host time whatever the chunk's size, so a small chunk (a prefix-cache hit's
suffix, a chunk squeezed between decode steps) is bound by the host, not the GPU. Here a
chunk of one request runs as the forward captured for the next *bucket* length (16, 32, 64,
..., up to a maximum), padded: ``runtime.metadata.chunk_metadata`` derives everything on the
device from the chunk's tokens and three scalars (slot, start, real length), padded rows
write their K/V into the dummy slot, attend to nothing and leave the Mamba state as it was.
A chunk past 512 tokens whose bucket would pad it by more than a quarter runs as two or
more pieces (the largest bucket that fits, then the rest). Graphs (a ``GraphRunner`` of
their own: its own memory pool) are captured the first time a bucket is needed, all smaller
buckets with it, with the dummy slot as the request, so capturing touches no real cache.

Without graphs (``capture=False``: the CPU, or a test of the padded path) the same padded
forward runs eagerly.
"""
from __future__ import annotations

import torch

from blockspec.models.nemotron_h import ModelOutput, NemotronHForCausalLM
from blockspec.runtime.graph_runner import GraphRunner
from blockspec.runtime.metadata import chunk_metadata

MIN_BUCKET = 16
PAD_FREE = 512      # buckets up to this are weight-bound: padding into them costs little
MAX_PAD = 0.25      # most padding above that (a fraction of the real rows) before a split


def buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, then 384, 512, 768, 1024, 1536, 2048, ... (1.5x and 4/3x
    steps), capped at ``max_tokens`` (itself a bucket)."""
    out, b = [], MIN_BUCKET
    while b < max_tokens:
        out.append(b)
        b = b * 2 if b < 256 else (b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3)
    return [*out, max_tokens] if max_tokens >= 1 else []


def pieces(n: int, sizes: list[int]) -> list[tuple[int, int]]:
    """(real rows, bucket) of each forward a chunk of ``n <= sizes[-1]`` tokens runs as: the
    smallest bucket that holds it, unless that pads by more than ``MAX_PAD``; then the
    largest bucket below it, and the rest the same way."""
    out = []
    while n > 0:
        fit = next(b for b in sizes if b >= n)
        if fit <= max(PAD_FREE, sizes[0]) or fit - n <= MAX_PAD * n:
            out.append((n, fit))
            break
        below = max(b for b in sizes if b < n)
        out.append((below, below))
        n -= below
    return out


class PrefillGraphs:
    def __init__(self, model: NemotronHForCausalLM, memory, attn, max_tokens: int,
                 capture: bool) -> None:
        self.model, self.memory, self.attn = model, memory, attn
        self.sizes = buckets(max_tokens)
        self.max_tokens = max_tokens
        dev = memory.device
        # slot, start, real length, then the tokens: one pinned upload per piece
        pin = dev.type == "cuda"
        self._host = torch.zeros(3 + max_tokens, dtype=torch.long, pin_memory=pin)
        self._dev = torch.zeros_like(self._host, device=dev) if pin else self._host
        self._scalars, self._ids = self._dev[:3], self._dev[3:]
        self._sent: torch.cuda.Event | None = None      # behind the last upload
        # keyed by (bucket, taps); a pool of its own (decode graphs keep state between steps)
        self.graphs = GraphRunner(dev, max_tokens, sizes=self.sizes) if capture else None
        self._eager_seq_len = 0

    def fits(self, n: int) -> bool:
        return 0 < n <= self.max_tokens

    def _forward(self, bucket: int, taps: tuple[int, ...]) -> tuple:
        """The padded forward of ``bucket`` rows from the static buffers: (logits [1, V],
        aux hidden [bucket, K*H] or None, positions and cache slots [2, bucket])."""
        m = self.memory
        slot, start, real = self._scalars[0:1], self._scalars[1:2], self._scalars[2:3]
        meta = chunk_metadata(self._ids[:bucket], slot, start, real, m.dummy_slot,
                              m.block_table, m.page_size, self.attn, m.kv, m.mamba,
                              capture_layers=taps, max_seq_len=self._eager_seq_len)
        out = self.model(meta)
        return out.logits, out.aux_hidden, torch.stack([meta.positions, meta.out_slots])

    def _load(self, slot: int, start: int, ids: list[int]) -> None:
        """The piece's tokens and scalars into the static buffers (one upload)."""
        if self._sent is not None:      # the last upload may still read the pinned rows
            self._sent.synchronize()
        n = 3 + len(ids)
        self._host[:n] = torch.tensor([slot, start, len(ids), *ids], dtype=torch.long)
        if self._dev is not self._host:
            self._dev[:n].copy_(self._host[:n], non_blocking=True)
            self._sent = torch.cuda.Event()
            self._sent.record()

    def _ensure(self, bucket: int, taps: tuple[int, ...]) -> None:
        """The graph of ``bucket`` and of every smaller bucket, captured largest first (they
        share the pool) with the dummy slot as the one real row, so no real cache is touched."""
        for b in sorted((s for s in self.sizes if s <= bucket), reverse=True):
            if not self.graphs.has((b, taps)):
                self._load(self.memory.dummy_slot, 0, [0])
                self.graphs.capture((b, taps), lambda b=b: self._forward(b, taps))

    @torch.inference_mode()
    def extend(self, slot: int, start: int, ids: list[int],
               taps: tuple[int, ...]) -> tuple[ModelOutput, torch.Tensor]:
        """``ModelRunner.extend`` of one request's chunk: the logits of its last row, the
        aux hidden states of its rows and their positions and cache slots."""
        aux, rows, logits, at = [], [], None, 0
        for real, bucket in pieces(len(ids), self.sizes):
            if self.graphs is not None:
                self._ensure(bucket, taps)
            self._load(slot, start + at, ids[at:at + real])
            if self.graphs is not None:
                out = self.graphs.replay((bucket, taps))
            else:
                self._eager_seq_len = start + at + real
                out = self._forward(bucket, taps)
            logits, hidden, where = out
            if hidden is not None:
                aux.append(hidden[:real].clone())
            rows.append(where[:, :real].clone())
            at += real
        result = ModelOutput(logits=logits.clone(), aux_hidden=torch.cat(aux) if aux else None)
        return result, torch.cat(rows, dim=1)
