"""Grammar-constrained steps in phases, so a step can start before its masks exist.

A constrained step's last part (masking, sampling or acceptance, commit) needs token bitmasks
that only the host's grammar matchers can compute, and they follow from the tokens the step
before commits. Everything before that part needs nothing from the host: the forward of an
AR step reads the last token the previous step left on the device; a speculative step's draft
and verify forwards read it too. So a constrained step is a chain of phases, each replayed
from its own CUDA graph (captured together per sampling mode and padded size, each phase
reading the static outputs of the one before):

* AR: forward -> finish (mask, sample, advance).
* Speculative: propose -> verify forward -> finish (mask, accept, commit, advance). The drafts
  are copied to the host behind the propose phase, so the host can walk them through the
  matchers while the verify forward runs. These phases run eagerly (``Plan.graphs`` False):
  replayed as graphs they made an illegal memory access on an H200 under a sampled batch of
  64 with admissions, which is not understood yet.

``begin`` launches every phase but the last; ``complete`` fills the masks and launches the
last. The scheduler begins step k + 1 before it reads step k back and completes it after the
matchers have taken step k's tokens, so the forward overlaps the host's work exactly as an
unconstrained step's launch-ahead does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from blockspec.grammar import Matcher
from blockspec.runtime.graph_runner import GraphRunner
from blockspec.runtime.launched import Launched, Plan
from blockspec.runtime.metadata import StepBatch, StepInputs


class Runner(Protocol):
    """What of ``ModelRunner`` the phases use (it owns a PhasedSteps)."""

    graphs: GraphRunner | None
    inputs: StepInputs
    host_max_seq_len: int

    def reserve_buffers(self, batch: StepBatch) -> None: ...

    def read_later(self, step: Launched, out: torch.Tensor) -> Launched: ...


@dataclass
class Pending:
    """A constrained step with every phase but the last launched."""

    kind: str
    key: tuple
    width: int
    bs: int
    padded: int | None
    plan: Plan
    out: Any                                # the last launched phase's output
    drafts: torch.Tensor | None = None      # host copy of the drafts (speculation)
    event: torch.cuda.Event | None = None   # recorded behind that copy
    tp_id: int = 0                          # its name on the tensor-parallel workers


class PhasedSteps:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._drafts_host: torch.Tensor | None = None

    @torch.inference_mode()
    def begin(self, batch: StepBatch | None, plan: Plan, kind: str, width: int,
              prev: Launched | None = None) -> Pending:
        """Launch all phases of ``plan`` but the last: for ``batch`` (filled from the host), or
        (None) for ``prev``'s requests from the inputs it advanced on the device."""
        r = self.runner
        if batch is not None:
            bs, key = batch.size, batch.sampling_key()
            self.prepare(batch, plan, kind)
        else:
            bs, key = prev.bs, prev.key     # plan / kind / width: the caller's (may change)
        padded = r.graphs.padded_size(bs) if r.graphs is not None and plan.graphs else None
        if batch is not None:
            if padded is None:
                r.host_max_seq_len = max(batch.prefix_lens) + width
            r.inputs.fill(batch, padded or bs, masks=False)
        elif padded is None:      # an upper bound: every length grew by at most ``width``
            r.host_max_seq_len += width
        inp = r.inputs.view(padded or bs)
        out, pending = None, Pending(kind, key, width, bs, padded, plan, None)
        for i, phase in enumerate(plan.phases[:-1]):
            out = (r.graphs.replay((kind, i, key, padded)) if padded is not None
                   else phase(inp, key, out))
            if i == 0 and plan.drafts_of is not None:
                pending.drafts, pending.event = self._drafts_to_host(plan.drafts_of(out)[:bs])
        pending.out = out
        return pending

    @torch.inference_mode()
    def prepare(self, batch: StepBatch, plan: Plan, kind: str) -> None:
        """``batch``'s buffers, and ``plan``'s phase graphs at its padded size when it replays
        them: ``begin`` does this for its own plan; a caller whose steps launched ahead may
        change plan (the speculative widths) calls it for each first."""
        r = self.runner
        r.reserve_buffers(batch)
        if r.graphs is not None and plan.graphs:
            padded = r.graphs.padded_size(batch.size)
            if padded is not None:
                self._ensure(kind, batch.sampling_key(), padded, plan)

    @torch.inference_mode()
    def complete(self, pending: Pending, grammars: list[Matcher | None]) -> Launched:
        """Fill every request's masks from its matcher (walking the drafts when speculating)
        and launch the last phase; the outputs are read back as any step's."""
        self.fill_masks(pending, grammars)
        return self.finish(pending)

    @torch.inference_mode()
    def fill_masks(self, pending: Pending, grammars: list[Matcher | None]) -> None:
        """The first half of ``complete``: the masks, from the matchers."""
        p = pending
        drafts = None
        if p.drafts is not None:
            if p.event is not None:
                p.event.synchronize()
            drafts = p.drafts.tolist()
        self.runner.inputs.fill_masks(grammars, drafts, rows=p.plan.rows, padded=p.padded or p.bs)

    @torch.inference_mode()
    def finish(self, pending: Pending) -> Launched:
        """The second half of ``complete``: the last phase, over the masks filled."""
        r, p = self.runner, pending
        last = len(p.plan.phases) - 1
        if p.padded is not None:
            out = r.graphs.replay((p.kind, last, p.key, p.padded))
        else:
            out = p.plan.phases[-1](r.inputs.view(p.bs), p.key, p.out)
        return r.read_later(Launched(p.kind, None, p.key, p.width, p.bs, out, plan=p.plan),
                            out[:p.bs])

    def _drafts_to_host(self, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if drafts.device.type != "cuda":
            return drafts, None
        need = (self.runner.inputs.max_bs, drafts.shape[1])
        if self._drafts_host is None or self._drafts_host.shape != need:
            self._drafts_host = torch.empty(need, dtype=drafts.dtype, pin_memory=True)
        host = self._drafts_host[: drafts.shape[0]]
        host.copy_(drafts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _ensure(self, kind: str, key: tuple, padded: int, plan: Plan) -> None:
        """Every phase's graph at ``padded`` and at each smaller captured size (as
        ``ModelRunner.ensure_graph``), each phase captured on the previous one's outputs."""
        r = self.runner
        for size in sorted((s for s in r.graphs.sizes if s <= padded), reverse=True):
            if r.graphs.has((kind, 0, key, size)):
                continue
            r.inputs.fill_dummy(0, size)
            r.inputs.upload()
            r.inputs.fill_masks([], rows=plan.rows, padded=size)
            out = None
            for i, phase in enumerate(plan.phases):
                inp = r.inputs.view(size)
                r.graphs.capture((kind, i, key, size),
                                 lambda phase=phase, inp=inp, prev=out: phase(inp, key, prev))
                out = r.graphs.output((kind, i, key, size))
