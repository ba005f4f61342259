"""Benchmark-only simulated acceptance: which drafts a verify accepts is forced by a
per-position profile instead of the target, so a random draft's steps can be timed at a
trained draft's acceptance (sglang's simulated acceptance, generalised to a profile).

Draft i (1-based) of a block is accepted with probability ``probs[i-1]`` given that drafts
1..i-1 were; a step accepts the leading run of its coins. ``blockspec bench``'s
``--simulate-accept-length TAU`` is the profile ``[1]*k + [frac] + [0]*...`` (k = floor(TAU-1),
frac = TAU-1-k): k or k+1 drafts, mixed so the mean committed length is TAU.

Low-acceptance phases (``every``, ``low_len``, ``low_scale``) multiply every probability by
``low_scale`` on a request's verify steps n with ``n mod every >= every - low_len``: the last
``low_len`` steps of each period of ``every``, so a run starts in the high phase. Everything
runs on the device from the step's own inputs (a graph replays it as it is).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class SimulatedAcceptance:
    """The profile and the phases on one device, ready to be captured into a step graph."""

    def __init__(self, probs: Sequence[float], device: torch.device | str, every: int = 0,
                 low_len: int = 0, low_scale: float = 1.0) -> None:
        if not probs or any(not 0.0 <= float(p) <= 1.0 for p in probs):
            raise ValueError(f"acceptance probabilities must be in [0, 1], got {list(probs)}")
        if every and not 0 < low_len < every:
            raise ValueError(f"low-acceptance phase length must be in [1, every - 1], got "
                             f"{low_len} of every {every}")
        self.probs = tuple(float(p) for p in probs)
        self.every, self.low_len, self.low_scale = int(every), int(low_len), float(low_scale)
        # made before any capture: a graph must not copy from the host
        self._table = torch.tensor(self.probs, dtype=torch.float64, device=device)

    def accepted(self, coins: torch.Tensor, verify_ctr: torch.Tensor) -> torch.Tensor:
        """Accepted drafts per row [B] (int64) from the coins ``[B, γ]`` (U[0, 1)) of the step
        and each request's verify steps so far ``[B]``."""
        gamma = coins.shape[1]
        if gamma > len(self.probs):
            raise ValueError(f"the acceptance profile has {len(self.probs)} positions, the "
                             f"verify block {gamma} drafts")
        p = self._table[:gamma].expand(coins.shape[0], gamma)
        if self.every:
            low = (verify_ctr.to(torch.int64) % self.every) >= self.every - self.low_len
            p = p * (1.0 - low.to(p.dtype) * (1.0 - self.low_scale))[:, None]
        return (coins < p).long().cumprod(dim=1).sum(dim=1)
