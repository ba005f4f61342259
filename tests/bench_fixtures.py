"""The benchmarks' parsed flags for tests: ``blockspec bench``'s parser on ``argv``, then any
field overridden by keyword (tests set what the command line would, without spelling flags)."""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from blockspec.bench.bench_args import add_arguments


def bench_args(argv: Sequence[str] = (), **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args(list(argv))
    ns.__dict__.update(kw)
    return ns
