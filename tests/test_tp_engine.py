"""Tensor parallelism in the engine: ``Engine(tp_size=2)`` (rank 0 in this process, one gloo
worker process) generates exactly what ``tp_size=1`` does: greedy and seeded sampling over a
batch larger than the running limit, a prompt prefilled in several chunks, penalties and
logprobs, prefix cache hits (the journaled block-table rows and Mamba snapshots), the prompt
scores, and DFlash / DSpark speculation with and without a grammar (drafts replicated on
every rank, reading the gathered hidden states). A worker that dies fails rank 0 at once; a
shutdown stops the workers."""
from __future__ import annotations

import itertools
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from blockspec.args import ArgsError, EngineArgs
from blockspec.cache import CacheLayout, MemoryManager
from blockspec.cli import build_parser
from blockspec.engine import tp_launch
from blockspec.engine.engine import Engine, GenerateError
from blockspec.engine.worker_node import run_worker_node
from blockspec.tiny_model import write_tiny_model
from tests.spec_fixtures import draft_config, make_spec_target, write_char_tokenizer, write_draft
from tests.test_dflash import HIDDEN, LAYERS, VOCAB

CHUNK = 16
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 120, 66, 12], [200, 31, 9, 77, 140],
           [(7 * i + 3) % 250 + 3 for i in range(3 * CHUNK + 5)],        # four prefill chunks
           [1, 2, 3], [44, 45, 46, 47, 48, 49, 50, 51, 52]]
ENGINE = {"device": "cpu", "chunked_prefill_size": CHUNK, "page_size": 4,
          "max_total_tokens": 2048, "max_running_requests": 4, "enable_radix_cache": True,
          "mamba_track_interval": 8, "mamba_cache_slots": 128}   # nothing evicted: LRU ties
# are broken by object ids, so which entries survive eviction differs from engine to engine


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tp_engine") / "tiny", seed=3)


@pytest.fixture(scope="class")
def pair(tiny: Path):
    one = Engine(model_path=str(tiny), tp_size=1, **ENGINE)
    two = Engine(model_path=str(tiny), tp_size=2, **ENGINE)
    yield one, two
    two.shutdown()
    one.shutdown()


class TestTiny:
    """One pair of engines for these tests (one tensor-parallel Engine per process at a time:
    the default process group is the process's)."""

    def test_greedy_batch_equals_single_process(self, pair) -> None:
        one, two = pair
        assert len(PROMPTS) > ENGINE["max_running_requests"]        # some wait for a slot
        assert two.model.rank_cfg.mamba_num_heads * 2 == two.config.mamba_num_heads   # a shard
        sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
        want = one.generate(input_ids=PROMPTS, sampling_params=sp)
        got = two.generate(input_ids=PROMPTS, sampling_params=sp)
        assert _ids(got) == _ids(want)
        assert all(len(o["output_ids"]) == 10 for o in got)


    def test_seeded_sampling_penalties_and_logprobs_equal(self, pair) -> None:
        one, two = pair
        sps = [{"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 100 + i,
                "ignore_eos": True, **({"repetition_penalty": 1.3, "presence_penalty": 0.5}
                                       if i % 2 else {})} for i in range(len(PROMPTS))]
        kw = {"return_logprob": True, "top_logprobs_num": 2}
        want = one.generate(input_ids=PROMPTS, sampling_params=sps, **kw)
        got = two.generate(input_ids=PROMPTS, sampling_params=sps, **kw)
        assert _ids(got) == _ids(want)
        greedy = [e.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 8, "temperature": 0})
                  for e in pair]                        # (both engines keep the same history)
        assert _ids(got) != _ids(greedy[0]) and _ids(greedy[0]) == _ids(greedy[1])   # it did sample
        for g, w in zip(got, want):
            lp_g = [lp for lp, _ in g["meta_info"]["output_token_logprobs"]]
            lp_w = [lp for lp, _ in w["meta_info"]["output_token_logprobs"]]
            torch.testing.assert_close(lp_g, lp_w, atol=1e-4, rtol=1e-4)


    def test_prefix_cache_hits_equal(self, pair) -> None:
        """The same prompts again: both resume from cached pages and Mamba snapshots (rank 0's
        bookkeeping, its device writes replayed on the worker) and answer the same."""
        one, two = pair
        sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        first = [e.generate(input_ids=PROMPTS, sampling_params=sp) for e in (two, one)]
        again = [e.generate(input_ids=PROMPTS, sampling_params=sp) for e in (two, one)]
        assert _ids(again[0]) == _ids(first[0]) == _ids(again[1]) == _ids(first[1])
        cached = [o["meta_info"]["cached_tokens"] for o in again[0]]
        assert cached[2] >= 3 * CHUNK, cached                 # the long prompt resumed deep inside
        assert cached == [o["meta_info"]["cached_tokens"] for o in again[1]]   # the same books


    def test_constrained_decoding_equals_single_process(self, pair) -> None:
        """Grammar masks (the first token's in ``sample_rows``, then each phased decode
        step's) come from rank 0's matchers and travel with the plans."""
        pytest.importorskip("xgrammar")
        one, two = pair
        sp = [{"max_new_tokens": 5, "temperature": 1.0, "seed": i, "regex": "[a-d]{4}x"}
              for i in range(3)]
        want = one.generate(input_ids=PROMPTS[:3], sampling_params=sp)
        got = two.generate(input_ids=PROMPTS[:3], sampling_params=sp)
        assert [o["text"] for o in got] == [o["text"] for o in want]
        assert all(re.fullmatch("[a-d]{4}x", o["text"]) for o in got), [o["text"] for o in got]

    def test_prompt_scores_equal(self, pair) -> None:
        one, two = pair
        want = one.runner.score(PROMPTS[:2])
        got = two.runner.score(PROMPTS[:2])
        for g, w in zip(got, want):
            assert g.shape == w.shape == (w.shape[0], one.config.vocab_size)
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# ---- speculation --------------------------------------------------------------------------
@pytest.fixture(scope="class", params=["DFLASH", "DSPARK"])
def spec_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_spec")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    write_char_tokenizer(folder, VOCAB)
    kind = request.param.lower()
    cfg = draft_config(kind, hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS,
                       block_size=4 if kind == "dflash" else 3,
                       **({"head_type": "gated"} if kind == "dspark" else {}))
    draft = write_draft(root / f"draft_{kind}", cfg, std=0.05)
    kw = dict(ENGINE, chunked_prefill_size=8, speculative_algorithm=request.param,
              speculative_draft_model_path=str(draft), speculative_adaptive=True)
    one = Engine(model_path=str(folder), tp_size=1, **kw)
    two = Engine(model_path=str(folder), tp_size=2, **kw)
    yield one, two
    two.shutdown()
    one.shutdown()


SPEC_PROMPTS = [[7, 5, 3, 9, 11, 2, 4, 6, 8, 10, 12, 1, 3, 20, 21, 22, 0, 1], [3, 4], [5, 6, 7, 8, 9]]


class TestSpeculation:
    def test_speculation_equals_single_process(self, spec_pair) -> None:
        one, two = spec_pair
        greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        sampled = [{"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 11 + i,
                    "ignore_eos": True} for i in range(len(SPEC_PROMPTS))]
        # The same widths (hence the same acceptance histograms) need the same cost table, and
        # one where speculation pays: a single process would time its eager steps (noisy on a
        # loaded CPU: a table where plain decoding won left no draft verified once), tensor
        # parallelism without graphs keeps the analytic shape. Both get a GPU-like table for
        # every eager size, so neither times anything.
        table = {(s, w): 1.0 + (0.2 if w > 1 else 0.0) + 0.05 * w
                 for s in (1, 2, 4, 8) for w in one.drafter.widths}
        for e in (one, two):
            e.drafter.chooser.cost.measured.update(table)
        for sp in (greedy, sampled):
            want = one.generate(input_ids=SPEC_PROMPTS, sampling_params=sp)
            assert one.drafter.chooser.cost.measured == table          # nothing was timed
            got = two.generate(input_ids=SPEC_PROMPTS, sampling_params=sp)
            assert _ids(got) == _ids(want)
            hist = [o["meta_info"]["spec_accept_histogram"] for o in got]
            assert hist == [o["meta_info"]["spec_accept_histogram"] for o in want]
            assert sum(sum(h[1:]) for h in hist) > 0, hist             # drafts were accepted


    def test_widths_chosen_on_rank_0_run_on_every_rank(self, spec_pair) -> None:
        """Each step's verify width (1 = plain decoding) is rank 0's choice; the worker runs
        the step of that kind."""
        one, two = spec_pair
        for e in spec_pair:
            e.drafter.chooser.force = itertools.cycle([1, 4, 2, 3])
        try:
            sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
            want = one.generate(input_ids=SPEC_PROMPTS, sampling_params=sp)
            got = two.generate(input_ids=SPEC_PROMPTS, sampling_params=sp)
        finally:
            for e in spec_pair:
                e.drafter.chooser.force = None
        assert _ids(got) == _ids(want)
        widths = [o["meta_info"]["spec_width_histogram"] for o in got]
        assert widths == [o["meta_info"]["spec_width_histogram"] for o in want]
        assert all(sum(1 for n in w if n) >= 3 for w in widths), widths    # several widths ran

    def test_constrained_speculation_equals_single_process(self, spec_pair) -> None:
        """Grammar masks come from rank 0's matchers and travel with the plans."""
        pytest.importorskip("xgrammar")
        one, two = spec_pair
        sp = [{"max_new_tokens": 3, "temperature": 1.0, "seed": i, "ignore_eos": True,
               "regex": "s[d-h][e-j]"} for i in range(4)]
        want = one.generate(input_ids=[[7, 5]] * 4, sampling_params=sp)
        got = two.generate(input_ids=[[7, 5]] * 4, sampling_params=sp)
        assert [o["text"] for o in got] == [o["text"] for o in want]
        assert all(o["text"][0] == "s" and o["text"][1] in "defgh" for o in got)


# ---- processes ------------------------------------------------------------------------------
def test_cache_journal_replays_the_bookkeeping_writes() -> None:
    """What a worker's caches receive: rank 0's block-table rows, Mamba resets and snapshot
    copies, replayed in order, leave its tables and states equal to rank 0's."""
    layout = CacheLayout(num_attention_layers=1, num_kv_heads=1, head_dim=4, num_mamba_layers=2,
                         conv_dim=16, mamba_heads=2, mamba_head_dim=4, ssm_state_size=2)
    kw = {"max_total_tokens": 64, "max_requests": 3, "page_size": 4, "dtype": torch.float32,
          "device": torch.device("cpu"), "prefix_cache": True, "mamba_track_interval": 4}
    rank0, worker = MemoryManager(layout, **kw), MemoryManager(layout, **kw)
    journal: list[tuple] = []
    rank0.record_device_ops(journal)
    kinds = set()

    def flush() -> None:                            # what goes ahead of each plan
        kinds.update(op[0] for op in journal)
        for op in journal:
            worker.replay_device_op(op)
        journal.clear()

    tokens = list(range(9))
    a = rank0.admit(12)
    flush()
    state = torch.randn(rank0.mamba.ssm[:, a.slot].shape)
    for m in (rank0, worker):                       # what the prefill plan writes on each rank
        m.mamba.ssm[:, a.slot] = state
    rank0.checkpoint(a, tokens[:8])                 # a snapshot of slot a
    rank0.release(a)
    b = rank0.admit(12, rank0.lookup(tokens))       # resumes from it: restore into its slot
    assert b.cached == 8
    flush()
    assert kinds == {"table", "reset", "save", "restore"}
    assert torch.equal(worker.block_table, rank0.block_table)
    assert torch.equal(worker.mamba.ssm, rank0.mamba.ssm)
    assert torch.equal(worker.mamba.ssm[:, b.slot], state)


def test_worker_crash_fails_loudly_and_shutdown_stops_workers(tiny: Path) -> None:
    e = Engine(model_path=str(tiny), tp_size=2, device="cpu", max_total_tokens=256)
    procs = list(e._tp.procs)
    try:
        assert e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 1 failed"):
            e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert time.monotonic() - t < 10
        assert not e.stats().alive
    finally:
        e.shutdown()
    assert not dist.is_initialized()
    again = Engine(model_path=str(tiny), tp_size=2, device="cpu", max_total_tokens=256)
    procs = list(again._tp.procs)
    assert again.generate(input_ids=[4, 5], sampling_params={"max_new_tokens": 2})["output_ids"]
    again.shutdown()
    assert [p.exitcode for p in procs] == [0]


def test_hung_worker_times_out_instead_of_waiting_forever(tiny: Path, monkeypatch) -> None:
    """A worker that stops answering (SIGSTOP: alive, silent) fails rank 0's next collective
    after the timeout; the shutdown then ends the worker instead of waiting for it."""
    monkeypatch.setattr(tp_launch, "COLLECTIVE_TIMEOUT_S", 2.0)
    e = Engine(model_path=str(tiny), tp_size=2, device="cpu", max_total_tokens=256)
    proc = e._tp.procs[0]
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor parallelism") as err:
            e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert time.monotonic() - t < 20
        assert "timed out" in str(err.value).lower(), err.value
    finally:
        t = time.monotonic()
        e.shutdown()
        assert time.monotonic() - t < 15
        assert not proc.is_alive()


def test_flags_and_refusals(tiny: Path) -> None:
    for flag in ("--tp-size", "--tensor-parallel-size"):
        ns = build_parser().parse_args(["generate", "x", flag, "2"])
        assert ns.tp_size == 2
    with pytest.raises(ArgsError, match="tp_size must be >= 1"):
        Engine(model_path=str(tiny), tp_size=0)
    with pytest.raises(GenerateError, match="from_model"):
        Engine.from_model(Engine(model_path=str(tiny), device="cpu").model, tp_size=2)


def test_expert_parallel_engine_equals_single_process(tiny: Path) -> None:
    """--ep-size 2 over the two ranks: each loads half the routed experts (renumbered), the
    same tokens come out, greedy and seeded."""
    one = Engine(model_path=str(tiny), **ENGINE)
    two = Engine(model_path=str(tiny), tp_size=2, ep_size=2, **ENGINE)
    try:
        moe = next(b.mixer for b in two.model.backbone.layers if b.kind == "moe")
        assert len(moe.experts) * 2 == two.config.n_routed_experts and moe.local == (0, 2)
        for sp in ({"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                   {"max_new_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True}):
            want = one.generate(input_ids=PROMPTS, sampling_params=sp)
            assert _ids(two.generate(input_ids=PROMPTS, sampling_params=sp)) == _ids(want)
    finally:
        two.shutdown()
        one.shutdown()


def test_expert_parallel_flags() -> None:
    for flag in ("--ep-size", "--expert-parallel-size"):
        ns = build_parser().parse_args(["generate", "x", "--tp-size", "2", flag, "2"])
        assert ns.ep_size == 2
    with pytest.raises(ArgsError, match="ep_size must be 1 or tp_size"):
        EngineArgs(model_path="x", tp_size=2, ep_size=4).validate()


def _node(folder: str, addr: str) -> None:
    run_worker_node(model_path=folder, device="cpu", tp_size=2, nnodes=2, node_rank=1,
                    dist_init_addr=addr, **{k: v for k, v in ENGINE.items() if k != "device"})


def test_two_nodes_on_loopback_equal_single_process(tiny: Path) -> None:
    """--nnodes 2: node 1 (another process, as another machine would be) runs rank 1 only and
    joins node 0's rendezvous at --dist-init-addr; node 0's engine answers as one process
    does, and its shutdown ends node 1."""
    addr = f"127.0.0.1:{tp_launch._free_port()}"
    node = mp.get_context("spawn").Process(target=_node, args=(str(tiny), addr))
    node.start()
    one = Engine(model_path=str(tiny), **ENGINE)
    try:
        two = Engine(model_path=str(tiny), tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr,
                     **ENGINE)
        try:
            assert two._tp.procs == []                       # rank 1 lives on node 1
            sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
            want = one.generate(input_ids=PROMPTS, sampling_params=sp)
            assert _ids(two.generate(input_ids=PROMPTS, sampling_params=sp)) == _ids(want)
        finally:
            two.shutdown()
        node.join(60)
        assert node.exitcode == 0
    finally:
        one.shutdown()
        if node.is_alive():
            node.kill()


def test_multi_node_flags() -> None:
    ns = build_parser().parse_args(["serve", "--model-path", "x", "--tp-size", "2", "--nnodes",
                                    "2", "--node-rank", "1", "--dist-init-addr", "h:5000"])
    assert (ns.nnodes, ns.node_rank, ns.dist_init_addr) == (2, 1, "h:5000")
    with pytest.raises(ArgsError, match="dist_init_addr"):
        EngineArgs(model_path="x", tp_size=2, nnodes=2).validate()
    with pytest.raises(ArgsError, match="multiple of nnodes"):
        EngineArgs(model_path="x", tp_size=3, nnodes=2, dist_init_addr="h:1").validate()
    with pytest.raises(ArgsError, match="node_rank"):
        EngineArgs(model_path="x", tp_size=2, nnodes=2, node_rank=2,
                   dist_init_addr="h:1").validate()
    with pytest.raises(ArgsError, match="node_rank > 0"):
        Engine(model_path="x", tp_size=2, nnodes=2, node_rank=1, dist_init_addr="h:1")


def test_expert_parallel_speculation_equals_single_process(tmp_path: Path) -> None:
    """DFlash over tp 2 with the routed experts split by expert: the same tokens and
    acceptance as one process, greedy and seeded."""
    _, folder = make_spec_target(tmp_path, offset=2.0, mix=0.3, pull=3.5)
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=4)
    draft = write_draft(tmp_path / "draft", cfg, std=0.05)
    kw = dict(ENGINE, chunked_prefill_size=8, speculative_algorithm="DFLASH",
              speculative_draft_model_path=str(draft))
    one = Engine(model_path=str(folder), **kw)
    two = Engine(model_path=str(folder), tp_size=2, ep_size=2, **kw)
    try:
        for sp in ({"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
                   [{"max_new_tokens": 12, "temperature": 1.0, "seed": 3 + i, "ignore_eos": True}
                    for i in range(len(SPEC_PROMPTS))]):
            want = one.generate(input_ids=SPEC_PROMPTS, sampling_params=sp)
            got = two.generate(input_ids=SPEC_PROMPTS, sampling_params=sp)
            assert _ids(got) == _ids(want)
            assert [o["meta_info"]["spec_accept_histogram"] for o in got] == \
                [o["meta_info"]["spec_accept_histogram"] for o in want]
    finally:
        two.shutdown()
        one.shutdown()
