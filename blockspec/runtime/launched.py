"""A step on its way: what the runner launched, and where its outputs will land."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

StepFn = Callable[[dict[str, torch.Tensor], tuple], torch.Tensor]
PhaseFn = Callable[[dict[str, torch.Tensor], tuple, Any], Any]


@dataclass(frozen=True)
class Plan:
    """How a grammar-constrained step runs (``runtime/phases.py``): its phases, each taking
    the previous one's output; the mask rows per request (1 for AR, the verify width for
    speculation); and, for speculation, where the drafts are in the first phase's output."""

    phases: tuple[PhaseFn, ...]
    rows: int
    drafts_of: Callable[[Any], torch.Tensor] | None = None
    graphs: bool = True              # False: the phases always run eagerly


@dataclass
class Launched:
    """What ran (to launch its continuation) and where its outputs land."""

    kind: str
    fn: StepFn | None                  # None for a phased step (``plan``)
    key: tuple
    width: int
    bs: int
    out: torch.Tensor                  # [bs, cols] host tensor (pinned on CUDA)
    event: torch.cuda.Event | None = None
    tag: object = None                 # the caller's (the scheduler's requests)
    plan: Plan | None = None
    tp_id: int = 0                     # its name on the tensor-parallel workers (tp_worker.py)
    # timed steps (ModelRunner.time_steps): on CUDA an event recorded just before the step ran
    # (``event`` then times too); on the CPU the eager call's seconds, known at launch
    started: torch.cuda.Event | None = None
    cpu_seconds: float | None = None

    def seconds(self) -> float | None:
        """The step's own time, start to output copy, once read back; None if not timed.
        Steps launched ahead queue behind each other, so a busy device's gaps are not in it."""
        if self.started is not None and self.event is not None:
            return self.started.elapsed_time(self.event) / 1e3
        return self.cpu_seconds
