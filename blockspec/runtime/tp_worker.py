"""Tensor parallelism in the engine: rank 0 schedules, every rank runs the same forwards.

Rank 0's runner is a ``MirroredRunner``: before each call that runs the model or writes
per-rank state (a prefill ``extend``, a decode or speculative ``launch_step``, a phased step's
``begin`` / ``complete``, the prefill's first-token ``sample_rows``, ``fill_penalties``, a CUDA
graph's ``ensure_graph``, the drafter's context write ``on_prefill``) it broadcasts a *plan*:
the method's name and its host arguments as plain Python data (slots, prefix lengths, token
lists, a ``StepBatch`` without its grammar matchers, the step *kind* that names the step
function, grammar mask rows), pickled over a gloo group (``PlanChannel``). Ahead of each plan
go the device writes rank 0's cache bookkeeping made since the last one (block-table rows,
Mamba slot resets, snapshot copies: ``MemoryManager.record_device_ops``). Each worker's
``serve`` loop receives the plans in order and makes the same calls on its own runner over its
own caches, so the collectives inside the model line up. A mirrored call made inside another
(``launch_step`` capturing a graph) is not announced: the worker's copy of the outer call makes
it too. This module is the one place that knows which calls those are.

A plan names the steps rank 0 launched (``tp_id``), so a step launched from the inputs the
previous one advanced on the device is the worker's continuation of its own copy. Tokens,
logprobs and accept lengths come from the gathered logits, equal on every rank: only rank 0
reads them back. CUDA graphs: every rank captures at the same mirrored calls (the same kinds,
sampling modes and padded sizes, in the same order) and replays the same graph at each step,
so the NCCL calls recorded in them pair up.

Failure is fatal and loud (``TPError``, which stops the engine loop): rank 0 checks its workers
before each plan (a worker that raised has reported and exited), a dead peer breaks its
collectives at once, and every collective has a timeout. An exception on rank 0 inside a
mirrored call leaves the ranks out of step, so it is fatal too.
"""
from __future__ import annotations

import contextlib
import itertools
import pickle
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from blockspec.runtime.launched import Launched
from blockspec.runtime.metadata import StepBatch
from blockspec.runtime.model_runner import ModelRunner
from blockspec.runtime.phases import Pending, PhasedSteps

KEEP_STEPS = 8          # launched / pending steps a worker remembers (continuations are recent)
PLAN_HEAD = 4096        # bytes of a plan's first broadcast (a decode step's plan fits)


class TPError(RuntimeError):
    """The tensor-parallel ranks can no longer run in step: a worker died or hung, or rank 0
    failed inside a mirrored call. ``fatal``: the engine loop ends every request and stops."""

    fatal = True


class Drafter(Protocol):
    def on_prefill(self, aux: torch.Tensor, rows: torch.Tensor) -> None: ...

    def by_kind(self, kind: str) -> tuple: ...


class PlanChannel:
    """The plans, in one order: rank 0 broadcasts, workers receive (pickles, as
    ``broadcast_object_list`` sends them, but in one broadcast for a small plan, and with a
    timeout on rank 0's side: gloo hands a message over only once the receiver asks for it,
    so a hung worker would hold rank 0 at its next plan forever; a worker waits for plans as
    long as the engine idles). ``check`` (rank 0) says why a worker is gone, or None while
    all are alive."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float | None = None,
                 check: Callable[[], str | None] = lambda: None) -> None:
        self.group = group
        self.timeout = None if timeout is None else timedelta(seconds=timeout)
        self.check = check
        self.journal: list[tuple] = []        # rank 0's cache device writes not yet sent
        self.broken: str | None = None
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, *call: Any, wait_s: float | None = None) -> None:
        """Broadcast one plan. ``wait_s`` replaces the timeout for this plan (the start's
        "build", which waits for workers still loading their shards)."""
        if self.broken is not None:
            raise TPError(self.broken)
        dead = self.check()
        if dead is not None:
            self.fail(dead)
        ops = list(self.journal)
        self.journal.clear()                  # in place: the memory manager appends to it
        data = pickle.dumps((ops, call))
        # one broadcast of a fixed-size head (the length, then the start of the pickle), a
        # second only for the rest of a large plan (a long prompt, mask rows)
        head = torch.zeros(PLAN_HEAD, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = data[:PLAN_HEAD - 8]
        head[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        parts = [head]
        if len(data) > len(first):
            parts.append(torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8))
        timeout = self.timeout if wait_s is None else timedelta(seconds=wait_s)
        try:
            for t in parts:
                work = dist.broadcast(t, src=0, group=self.group, async_op=True)
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timeout=timeout)
        except Exception as e:          # noqa: BLE001 - any transport error ends the group
            self.fail(self.check() or f"sending the {call[0]!r} plan failed (a worker that no "
                                      f"longer answers?): {e}")

    def recv(self) -> tuple[list[tuple], tuple]:
        head = torch.empty(PLAN_HEAD, dtype=torch.uint8)
        dist.broadcast(head, src=0, group=self.group)
        n = int(head[:8].view(torch.int64))
        data = head[8:8 + n].numpy().tobytes()
        if n > len(data):
            rest = torch.empty(n - len(data), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def fail(self, why: str, cause: BaseException | None = None) -> None:
        self.broken = f"tensor parallelism: {why}"
        raise TPError(self.broken) from cause


def step_of(runner: ModelRunner, drafter: Drafter | None, kind: str) -> tuple:
    """(step function, phased plan) a step of ``kind`` runs: the runner's "decode", the
    drafter's "spec<w>"."""
    return runner.by_kind(kind) if kind == "decode" else drafter.by_kind(kind)


def _plain(batch: StepBatch | None) -> tuple[StepBatch | None, list[bool] | None]:
    """A batch as plain data: without its matchers, and which rows had one."""
    if batch is None or batch.grammars is None:
        return batch, None
    return replace(batch, grammars=None), [g is not None for g in batch.grammars]


class _MaskRows:
    """A worker's stand-in for a request's grammar matcher: the mask rows rank 0's matcher
    filled (None where the worker never fills masks from it)."""

    def __init__(self, rows: np.ndarray | None) -> None:
        self.rows = rows

    def fill(self, out: torch.Tensor, drafts: object = ()) -> None:
        out.copy_(torch.from_numpy(self.rows))


def _restore(batch: StepBatch | None, flags: list[bool] | None,
             masks: np.ndarray | None) -> StepBatch | None:
    if batch is None or flags is None:
        return batch
    rows = [_MaskRows(masks[b] if masks is not None else None) if f else None
            for b, f in enumerate(flags)]
    return replace(batch, grammars=rows)



def _id_of(step: Launched | Pending | None) -> int:
    """A step's name on the workers (0: none, a fresh batch)."""
    return step.tp_id if step is not None else 0

class MirroredRunner(ModelRunner):
    """Rank 0's runner: every call that runs the model or writes per-rank state is announced
    to the workers first (see the module docstring)."""

    def __init__(self, *args: Any, channel: PlanChannel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.channel = channel
        self.phased = MirroredPhases(self)
        self.memory.record_device_ops(channel.journal)
        self.drafter: Drafter | None = None      # resolves the "spec<w>" kinds (the check)
        self._depth = 0
        self._last: tuple | None = None          # the last extend's (output, rows)

    @contextlib.contextmanager
    def mirrored(self, *call: Any) -> Iterator[None]:
        """Announce ``call`` (unless inside another mirrored call), then run the body; a
        failure in it is fatal (the workers ran, or are running, their copy)."""
        if self._depth:
            yield
            return
        self.channel.send(*call)
        self._depth += 1
        try:
            yield
        except Exception as e:
            self.channel.fail(self.channel.check() or (
                f"rank 0 failed inside {call[0]!r} ({type(e).__name__}: {e}); the ranks are "
                "out of step"), cause=e)
        finally:
            self._depth -= 1

    def _check_kind(self, kind: str, obj: object, which: int) -> None:
        """The worker names the step by its kind alone: it must be the one rank 0 runs."""
        if step_of(self, self.drafter, kind)[which] != obj:
            raise ValueError(f"under tensor parallelism a {kind!r} step must run the "
                             "runner's or drafter's own step for that kind")

    def extend(self, slots: list[int], starts: list[int], ids: list[list[int]],
               logits_all: bool = False, capture_layers: tuple[int, ...] | None = None,
               rows: list[int] | None = None):
        layers = self.capture_layers if capture_layers is None else tuple(capture_layers)
        with self.mirrored("extend", list(slots), list(starts), [list(x) for x in ids],
                           logits_all, layers, None if rows is None else list(rows)):
            self._last = super().extend(slots, starts, ids, logits_all, layers, rows)
        return self._last

    @torch.inference_mode()
    def sample_rows(self, logits: torch.Tensor, batch: StepBatch,
                    rows: list[int] | None = None) -> torch.Tensor:
        if self._last is None or logits is not self._last[0].logits:
            raise ValueError("under tensor parallelism sample_rows takes the last extend's logits")
        # no collective inside (the logits are gathered already), so rank 0 runs first and
        # sends the grammar masks it filled with the plan
        out = super().sample_rows(logits, batch, rows)
        plain, flags = _plain(batch)
        masks = (self.inputs.mask_host[:batch.size, :1].numpy().copy()
                 if flags is not None else None)
        with self.mirrored("sample_rows", plain, flags, masks, rows):
            pass
        return out

    def fill_penalties(self, slot: int, prompt_ids: list[int], output_ids: list[int],
                       params: object, banned: list[int]) -> None:
        with self.mirrored("fill_penalties", slot, list(prompt_ids), list(output_ids), params,
                           list(banned)):
            super().fill_penalties(slot, prompt_ids, output_ids, params, banned)

    def ensure_graph(self, kind: str, key: tuple, padded: int, fn) -> tuple:
        self._check_kind(kind, fn, 0)
        with self.mirrored("ensure_graph", kind, key, padded):
            return super().ensure_graph(kind, key, padded, fn)

    def launch_step(self, batch: StepBatch | None, fn, kind: str, width: int,
                    prev: Launched | None = None) -> Launched:
        self._check_kind(kind, fn, 0)
        return self.named_step(partial(super().launch_step, batch, fn, kind, width, prev),
                               "launch_step", *_plain(batch), kind, width, _id_of(prev))

    def named_step(self, run: Callable[[], Any], *call: Any) -> Any:
        """Announce ``call`` with a new id at its end, run the step, and give it that id:
        the workers name the step so, and a later step launched from it names it back."""
        sid = self.channel.next_id()
        with self.mirrored(*call, sid):
            step = run()
        step.tp_id = sid
        return step


class MirroredPhases(PhasedSteps):
    """Rank 0's grammar-constrained steps: ``begin`` announced as it is; ``complete`` fills
    the masks from the matchers first and sends them with its plan."""

    runner: MirroredRunner

    def begin(self, batch: StepBatch | None, plan, kind: str, width: int,
              prev: Launched | None = None) -> Pending:
        r = self.runner
        r._check_kind(kind, plan, 1)
        return r.named_step(partial(super().begin, batch, plan, kind, width, prev),
                            "begin", *_plain(batch), kind, width, _id_of(prev))

    @torch.inference_mode()
    def complete(self, pending: Pending, grammars: list) -> Launched:
        r = self.runner
        self.fill_masks(pending, grammars)
        n = max(pending.bs, pending.padded or 0)
        masks = r.inputs.mask_host[:n, :pending.plan.rows].numpy().copy()
        return r.named_step(partial(self.finish, pending), "complete", pending.tp_id, masks)


class MirroredDrafter:
    """Rank 0's drafter: the drafter itself (attributes read and set through), its prefill
    context write announced."""

    def __init__(self, drafter: Drafter, runner: MirroredRunner) -> None:
        object.__setattr__(self, "_drafter", drafter)
        object.__setattr__(self, "_runner", runner)
        runner.drafter = drafter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._drafter, name, value)

    def on_prefill(self, aux: torch.Tensor, rows: torch.Tensor) -> None:
        last = self._runner._last
        if last is None or aux is not last[0].aux_hidden:
            raise ValueError("under tensor parallelism on_prefill takes the last extend's output")
        with self._runner.mirrored("on_prefill"):
            self._drafter.on_prefill(aux, rows)


@torch.inference_mode()
def serve(channel: PlanChannel, runner: ModelRunner, drafter: Drafter | None = None) -> None:
    """A worker's loop: replay rank 0's cache writes, then make the call each plan names,
    until the "stop" plan. Raises on anything unexpected (the worker then reports and exits)."""
    steps: dict[int, Any] = {}          # rank 0's step ids -> this rank's Launched / Pending
    last: tuple | None = None           # this rank's last extend (output, rows)
    cuda = runner.device.type == "cuda"

    def prev_of(i: int) -> Any:
        if i and i not in steps:
            raise TPError(f"plan continues step {i}, which this rank does not have")
        return steps.get(i)

    def settle(batch: object) -> None:
        # rank 0 has read every earlier step back before it fills fresh step inputs; this
        # rank reads nothing back, so it waits for its own before overwriting the buffers
        if cuda and batch is not None:
            torch.cuda.current_stream(runner.device).synchronize()

    while True:
        ops, call = channel.recv()
        for op in ops:
            runner.memory.replay_device_op(op)
        name, *a = call
        if name == "stop":
            return
        if name == "extend":
            last = runner.extend(*a)
        elif name == "on_prefill":
            drafter.on_prefill(last[0].aux_hidden, last[1])
        elif name == "sample_rows":
            batch, flags, masks, rows = a
            settle(batch)
            runner.sample_rows(last[0].logits, _restore(batch, flags, masks), rows)
        elif name == "fill_penalties":
            runner.fill_penalties(*a)
        elif name == "ensure_graph":
            kind, key, padded = a
            runner.ensure_graph(kind, key, padded, step_of(runner, drafter, kind)[0])
        elif name == "launch_step":
            batch, _, kind, width, prev, sid = a
            settle(batch)
            steps[sid] = runner.launch_step(batch, step_of(runner, drafter, kind)[0], kind, width,
                                            prev_of(prev))
        elif name == "begin":
            batch, flags, kind, width, prev, pid = a
            settle(batch)
            steps[pid] = runner.phased.begin(_restore(batch, flags, None),
                                             step_of(runner, drafter, kind)[1], kind, width,
                                             prev_of(prev))
        elif name == "complete":
            pid, masks, sid = a
            pending = prev_of(pid)
            runner.inputs.put_masks(torch.from_numpy(masks))
            steps[sid] = runner.phased.finish(pending)
        else:
            raise TPError(f"unknown plan {name!r}")
        for old in sorted(steps)[:-KEEP_STEPS]:
            del steps[old]
