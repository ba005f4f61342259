"""Latency statistics the benchmarks report (no torch, no server: any bench may import it)."""
from __future__ import annotations

import math


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no samples."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]
