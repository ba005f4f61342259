"""Benchmark mode's committed text. A random-weight model's own argmax falls into loops whose
MoE routing differs from run to run (and from width to width, once accepted random drafts
enter the context), so its step costs are not comparable; under the bench's simulation every
step commits this text instead, plain decoding and every verify width alike."""
from __future__ import annotations

import torch

from blockspec.sampling import Stream, uniforms


def simulated_text(seeds: torch.Tensor, counters: torch.Tensor, n: int,
                   vocab: int) -> torch.Tensor:
    """[N, n] int64: output token k of a request (k = ``counters`` + j) is a uniformly random
    token, a pure function of (seed, k), so whichever step commits it, it is the same."""
    ks = counters.to(seeds.device, torch.int64)[:, None] + torch.arange(n, device=seeds.device)
    u = uniforms(seeds[:, None].expand(-1, n).reshape(-1), ks.reshape(-1), Stream.TEXT, 1)
    return (u.view(-1, n) * vocab).long().clamp_max(vocab - 1)
