"""Token progress for the CLI: a stderr bar that appears only once a generation has run for
``delay`` seconds, so short runs print nothing and long prefills do not look hung."""
from __future__ import annotations

import sys
from tqdm import tqdm


class TokenProgress:
    """``Engine.on_step``: called with (tokens done, tokens total) of a generate call as its
    outputs arrive (prompt tokens count once a request's first token is out; a finished request
    counts in full)."""

    def __init__(self, enabled: bool, delay: float = 3.0) -> None:
        self.enabled = enabled
        self.delay = delay
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = tqdm(total=total, unit="tok", delay=self.delay, file=sys.stderr,
                            disable=not self.enabled, leave=False, dynamic_ncols=True)
        if not self.bar.disable:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
