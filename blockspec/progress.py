"""Token progress for the CLI: a stderr bar that appears only once a generation has run for
``delay`` seconds, so short runs print nothing and long prefills do not look hung."""
from __future__ import annotations

import sys
from collections.abc import Sequence

from tqdm import tqdm

from blockspec.engine.request import Request


class TokenProgress:
    """Call with the batch's requests after every engine step (``Engine.on_step``). Counts
    prompt tokens prefilled plus tokens generated; a finished request counts as complete."""

    def __init__(self, enabled: bool, delay: float = 3.0) -> None:
        self.enabled = enabled
        self.delay = delay
        self.bar: tqdm | None = None

    def __call__(self, reqs: Sequence[Request]) -> None:
        if self.bar is None:
            total = sum(len(r.prompt_ids) + r.params.max_new_tokens for r in reqs)
            self.bar = tqdm(total=total, unit="tok", delay=self.delay, file=sys.stderr,
                            disable=not self.enabled, leave=False, dynamic_ncols=True)
        if self.bar.disable:
            return
        done = sum(len(r.prompt_ids) + r.params.max_new_tokens if r.finished
                   else min(r.num_cached, len(r.prompt_ids)) + len(r.output_ids) for r in reqs)
        self.bar.set_description("prefill" if any(not r.prefilled for r in reqs) else "generate",
                                 refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
