"""What a captured CUDA graph relies on. It keeps raw addresses, not Python references: every
storage a capture reads or writes that it did not allocate itself (static inputs, caches,
pools, the outputs of the phase before) must outlive the graph, or a replay touches freed
memory. And it replays the ops it recorded: a step must not depend on host values that change
after capture. Checked on CPU with stand-in graphs that record each capture's outside storages
(weak references) and ops, and replay by running the step eagerly and comparing its ops, over
a serving run with grammar-constrained and free requests, greedy and sampled, penalties,
logprobs, admissions and verify widths changing every step; the speculative phases are
captured too, although serving runs them eagerly. What it covers: every torch op of the steps
(metadata, acceptance, sampling, the EWMA, the inputs' advance, the CPU references of the
layers); what it cannot see: buffers that only a Triton or CUDA launch touches on the GPU
(those launches do not pass the dispatcher)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

pytest.importorskip("xgrammar")

from blockspec import Engine  # noqa: E402
from blockspec.runtime.graph_runner import GraphRunner  # noqa: E402
from blockspec.runtime.metadata import StepInputs  # noqa: E402
from tests.spec_fixtures import (draft_config, make_spec_target,  # noqa: E402
                                 write_char_tokenizer, write_draft)
from tests.test_dflash import HIDDEN, LAYERS, VOCAB  # noqa: E402

SIZES = [1, 4]


class OutsideReads(TorchDispatchMode):
    """Storages the ops under it touch that none of them allocated, as weak references (keyed
    by storage; a key whose storage died names a new one)."""

    def __init__(self) -> None:
        super().__init__()
        self.own: dict[int, StorageWeakRef] = {}
        self.outside: dict[int, tuple[StorageWeakRef, str]] = {}
        self.lost: list[str] = []       # outside storages that died within the capture
        self.ops: list[tuple] = []      # what ran: op, argument shapes and scalars

    def _seen(self, st: torch.UntypedStorage) -> bool:
        key = st._cdata
        if key in self.own and not self.own[key].expired():
            return True
        if key in self.outside:
            if not self.outside[key][0].expired():
                return True
            self.lost.append(self.outside.pop(key)[1])
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = tree_flatten((args, kwargs or {}))[0]
        ins = [t for t in flat if isinstance(t, torch.Tensor)]
        if not func.is_view:            # a view is metadata: no launch reads the storage
            self.ops.append((str(func), *(tuple(a.shape) if isinstance(a, torch.Tensor) else
                                          a if isinstance(a, (int, float, bool)) else None
                                          for a in flat)))
            for t in ins:
                st = t.untyped_storage()
                if st.nbytes() and not self._seen(st):
                    self.outside[st._cdata] = (StorageWeakRef(st), f"{func} {tuple(t.shape)}")
        out = func(*args, **(kwargs or {}))
        aliased = {t.untyped_storage()._cdata for t in ins} if func.is_view else set()
        for t in tree_flatten(out)[0]:      # new storage (a view op may copy: to(dtype))
            if (isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in aliased
                    and not self._seen(t.untyped_storage())):
                self.own[t.untyped_storage()._cdata] = StorageWeakRef(t.untyped_storage())
        return out


class StandInGraphs(GraphRunner):
    """``GraphRunner`` with capture = two warm-up runs and one recorded run (its output kept,
    as a graph keeps its static output) and replay = the step or phase run eagerly, of a key
    captured before (a step launched ahead at another width needs that width's graph), which
    must run the captured ops. Sizes, lookups and static outputs are the runner's own."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(torch.device("cpu"), max(SIZES), SIZES)
        self.engine = engine
        self.diverged: set = set()
        self._last: dict = {}

    def capture(self, key, fn) -> None:
        fn()
        fn()
        rec = OutsideReads()
        with rec:
            out = fn()
        self._graphs[key] = (rec, out)      # the recorder stands where the graph would

    def _plan(self, kind: str) -> tuple:
        e = self.engine
        return e.runner.by_kind(kind) if kind == "decode" else e.drafter.by_kind(kind)

    def replay(self, key):
        """The step run eagerly under a fresh recorder; a different op sequence (shapes,
        scalar arguments) than the capture's is what a graph would not have replayed."""
        captured = self._graphs[key][0]          # KeyError, as the runner: never captured
        rec = OutsideReads()
        with rec:
            out = self._run(key)
        if rec.ops != captured.ops:
            self.diverged.add(key)
        return out

    def _run(self, key):
        inputs = self.engine.runner.inputs
        if len(key) == 3:                         # a whole step: (kind, sampling key, size)
            kind, skey, size = key
            return self._plan(kind)[0](inputs.view(size), skey)
        kind, i, skey, size = key                 # a phase: (kind, phase, sampling key, size)
        chain = (kind, skey, size)
        out = self._plan(kind)[1].phases[i](inputs.view(size), skey,
                                            self._last.get(chain) if i else None)
        self._last[chain] = out
        return out

    def dead(self) -> list[tuple]:
        return [(key, what) for key, (rec, _) in self._graphs.items()
                for what in rec.lost + [w for ref, w in rec.outside.values() if ref.expired()]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("liveness")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    write_char_tokenizer(folder, VOCAB)
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=4)
    return folder, write_draft(root / "draft", cfg, std=0.05)


def _serve(folders) -> StandInGraphs:
    folder, draft = folders
    e = Engine(model_path=str(folder), device="cpu", max_running_requests=max(SIZES),
               max_total_tokens=max(SIZES) * 64, speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(draft), speculative_adaptive=True)
    d = e.drafter
    d._plans = {w: dataclasses.replace(p, graphs=True) for w, p in d._plans.items()}
    graphs = e.runner.graphs = StandInGraphs(e)
    e.runner.host_max_seq_len = 256        # the CPU attention's context bound, any step's
    rng = random.Random(0)
    d.chooser.force = iter(lambda: rng.randint(1, d.width), None)
    prompts, params = [], []
    for i in range(16):
        prompts.append([7, 5, 3 + i % 5])
        p = {"max_new_tokens": 12, "temperature": 1.0 if i % 2 else 0.0, "seed": i,
             **({"frequency_penalty": 0.5} if i % 5 == 0 else {})}
        params.append(p if i % 3 == 0 else {**p, "regex": "s[d-h]{2,5}[e-j]{2,6}"})
    try:
        e.generate(input_ids=prompts[:4], sampling_params=params[0:12:3])     # free: whole steps
        e.generate(input_ids=prompts, sampling_params=params)
        e.generate(input_ids=prompts[:6], sampling_params=params[:6], return_logprob=True,
                   top_logprobs_num=2)
    finally:
        e.shutdown()
    return graphs


def test_captured_steps_never_touch_freed_storage(folders):
    graphs = _serve(folders)
    kinds = {len(k) for k in graphs._graphs}
    assert kinds == {3, 4}, kinds                       # whole steps and phases were captured
    assert graphs.dead() == []
    assert not graphs.diverged, sorted(graphs.diverged)[:5]


def test_the_check_sees_a_buffer_replaced_after_capture(folders, monkeypatch):
    """The check can fail: bitmask buffers made anew for each constrained batch leave the
    phases captured before reading the old ones."""
    keep = StepInputs.reserve_masks

    def anew(self, width, words):
        self.mask_host = None
        keep(self, width, words)
    monkeypatch.setattr(StepInputs, "reserve_masks", anew)
    dead = _serve(folders).dead()
    assert dead and all(key[1] == 2 for key, _ in dead)     # the finishing phases read masks


def test_the_check_sees_a_replay_that_is_not_the_capture(folders, monkeypatch):
    """The check can fail: a host value the steps read changing after capture (the CPU
    attention's context bound sizes its gather) gives a replay other ops than the graph's."""
    engine = Engine.__init__

    def toggling(self, *args, **kwargs):
        engine(self, *args, **kwargs)
        runner = self.runner
        launch = runner.launch_step

        def launch_step(*a, **k):
            runner.host_max_seq_len = 511 - runner.host_max_seq_len     # 256 <-> 255
            return launch(*a, **k)
        runner.launch_step = launch_step
    monkeypatch.setattr(Engine, "__init__", toggling)
    assert _serve(folders).diverged
