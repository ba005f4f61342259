"""A step that raises ends only the request that made it fail: the others in the same batch go
on from their committed state and give exactly the tokens of a run without the bad request."""
from __future__ import annotations

import threading

import pytest

from blockspec import Engine
from blockspec.engine.request import Request
from blockspec.forward_metadata import Mode
from blockspec.sampling import SamplingParams
from tests.polling import wait_until  # noqa: E402

PROMPTS = [[5, 17, 33, 8], [44, 3, 9], [70, 71, 72, 73, 74]]
PARAMS = [{"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True},
          {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True},
          {"max_new_tokens": 40, "temperature": 0.9, "top_p": 0.95, "seed": 5, "ignore_eos": True}]


@pytest.fixture(scope="module")
def clean(tiny_folder):
    """The innocents' outputs in a run without the bad request."""
    e = Engine(model_path=str(tiny_folder), device="cpu")
    try:
        return [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
    finally:
        e.shutdown()


class Collect:
    """A sink per request: every output, in order."""

    def __init__(self) -> None:
        self.outs: dict[str, list] = {}
        self.lock = threading.Lock()

    def sink(self, rid: str):
        self.outs[rid] = []

        def put(out):
            with self.lock:
                self.outs[rid].append(out)
        return put

    def ids(self, rid: str) -> list[int]:
        with self.lock:
            return [t for o in self.outs[rid] for t in o.token_ids]

    def done(self, rid: str) -> bool:
        with self.lock:
            return bool(self.outs[rid]) and self.outs[rid][-1].finished

    def reason(self, rid: str) -> dict:
        with self.lock:
            return self.outs[rid][-1].finish_reason


def _run_with_culprit(engine: Engine, culprit: Request, c: Collect) -> list[str]:
    """Start the innocents, let them decode a few steps, slip the culprit into their batch
    past the engine's own checks (as a value no check foresaw would), wait for everyone."""
    rids = [engine.submit(ids, SamplingParams.from_dict(p), c.sink(f"ok{i}"), rid=f"ok{i}")
            for i, (ids, p) in enumerate(zip(PROMPTS, PARAMS))]
    wait_until(lambda: all(len(c.ids(r)) >= 3 for r in rids))
    engine._loop.submit(culprit, c.sink(culprit.rid))
    wait_until(lambda: all(c.done(r) for r in rids + [culprit.rid]))
    return rids


def test_a_value_the_step_row_cannot_hold_fails_only_its_request(tiny_folder, clean):
    e = Engine(model_path=str(tiny_folder), device="cpu")
    try:
        params = SamplingParams(max_new_tokens=40, temperature=0.8, ignore_eos=True)
        params.top_k = 2**63                        # past validation: overflows the int64 row
        culprit = Request(rid="bad", prompt_ids=[9, 9, 9], params=params)
        c = Collect()
        rids = _run_with_culprit(e, culprit, c)
        reason = c.reason("bad")
        assert reason["type"] == "error" and "top_k" in reason["message"], reason
        for rid, want in zip(rids, clean):
            assert c.reason(rid)["type"] == "length"
            assert c.ids(rid) == want                # nothing lost, nothing repeated
        assert e.stats().cache_usage == 0.0 and e.stats().running == 0
    finally:
        e.shutdown()


def test_a_step_failing_mid_forward_is_bisected_to_its_request(tiny_folder, clean):
    """The forward raises after the first Mamba layer has advanced the state of every row,
    whenever the culprit's row reaches one position: the innocents in that batch are rolled
    back and computed again, the culprit is found by running halves of the batch alone."""
    e = Engine(model_path=str(tiny_folder), device="cpu")
    try:
        culprit = Request(rid="bad", prompt_ids=[11, 12, 13],
                          params=SamplingParams(max_new_tokens=40, temperature=0.0,
                                                ignore_eos=True))
        trigger = len(culprit.prompt_ids) + 4          # its fifth decode step
        model = e.model
        real = type(model)._mamba
        fired = {"n": 0}

        def failing(mixer, n, x, meta):
            out = real(mixer, n, x, meta)              # the state has moved on: now fail
            slot = culprit.cache.slot
            if meta.mode == Mode.DECODE and slot >= 0:
                rows = (meta.req_slots == slot).nonzero().flatten().tolist()
                if rows and int(meta.positions[rows[0]]) == trigger:
                    fired["n"] += 1
                    raise RuntimeError("injected failure in the culprit's row")
            return out

        model._mamba = failing
        c = Collect()
        rids = _run_with_culprit(e, culprit, c)
        reason = c.reason("bad")
        assert reason["type"] == "error" and "injected failure" in reason["message"], reason
        assert fired["n"] >= 2                         # in the batch, then alone
        assert c.ids("bad") and len(c.ids("bad")) < 40
        for rid, want in zip(rids, clean):
            assert c.reason(rid)["type"] == "length", c.reason(rid)
            assert c.ids(rid) == want, rid             # token for token, none lost or repeated
        assert e.stats().cache_usage == 0.0 and e.stats().running == 0
        # the loop carries on: the next request runs as usual
        out = e.generate(input_ids=PROMPTS[0], sampling_params=PARAMS[0])
        assert out["output_ids"] == clean[0]
    finally:
        e.shutdown()


def test_a_failure_in_a_prefill_batch_fails_only_its_request(tiny_folder, clean):
    """Several prompts prefilled in one forward, one of which makes it fail: the others are
    found innocent and complete as in a clean run."""
    e = Engine(model_path=str(tiny_folder), device="cpu")
    try:
        poison = 258
        real = type(e.model)._mamba

        def failing(mixer, n, x, meta):
            out = real(mixer, n, x, meta)
            if meta.mode == Mode.EXTEND and bool((meta.input_ids == poison).any()):
                raise RuntimeError("injected prefill failure")
            return out

        e.model._mamba = failing
        prompts = PROMPTS + [[1, 2, poison, 4]]
        params = PARAMS + [PARAMS[0]]
        with pytest.raises(RuntimeError, match="injected prefill failure"):
            e.generate(input_ids=prompts, sampling_params=params)
        c = Collect()
        with e._loop.grouped():                    # all four in the same prefill forward
            for i, (ids, p) in enumerate(zip(prompts, params)):
                e.submit(ids, SamplingParams.from_dict(p), c.sink(f"r{i}"), rid=f"r{i}")
        wait_until(lambda: all(c.done(f"r{i}") for i in range(4)))
        assert c.reason("r3")["type"] == "error"
        for i, want in enumerate(clean):
            assert c.reason(f"r{i}")["type"] == "length"
            assert c.ids(f"r{i}") == want
    finally:
        e.shutdown()


def test_speculative_batch_is_bisected_too(tmp_path):
    """DFlash: the culprit's verify fails after the target's Mamba layer ran; the innocents'
    draft context and Mamba state are computed again and their tokens match a clean run."""
    from tests.spec_fixtures import draft_config, make_spec_target, write_draft

    _, target = make_spec_target(tmp_path, offset=2.0, mix=0.3, pull=3.5)
    draft = write_draft(tmp_path / "draft", draft_config("dflash", hidden=32, vocab=24,
                                                         target_layers=7, block_size=4), std=0.05)
    kw = dict(model_path=str(target), device="cpu", speculative_algorithm="DFLASH",
              speculative_draft_model_path=str(draft))
    prompts = [[1, 2, 3], [7, 8], [4, 4, 9, 10]]
    params = [{"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True},
              {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True},
              {"max_new_tokens": 30, "temperature": 0.8, "seed": 3, "ignore_eos": True}]
    with Engine(**kw) as ref:
        want = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=params)]
    e = Engine(**kw)
    try:
        culprit = Request(rid="bad", prompt_ids=[12, 13], params=SamplingParams(
            max_new_tokens=30, temperature=0.0, ignore_eos=True))
        real = type(e.model)._mamba
        fired = {"n": 0}

        def failing(mixer, n, x, meta):
            out = real(mixer, n, x, meta)
            slot = culprit.cache.slot
            if meta.mode == Mode.VERIFY and slot >= 0:
                rows = (meta.req_slots[meta.row_req] == slot).nonzero().flatten().tolist()
                if rows and int(meta.positions[rows[0]]) >= 10:
                    fired["n"] += 1
                    raise RuntimeError("injected verify failure")
            return out

        e.model._mamba = failing
        c = Collect()
        rids = [e.submit(ids, SamplingParams.from_dict(p), c.sink(f"ok{i}"), rid=f"ok{i}")
                for i, (ids, p) in enumerate(zip(prompts, params))]
        wait_until(lambda: all(len(c.ids(r)) >= 2 for r in rids))
        e._loop.submit(culprit, c.sink("bad"))
        wait_until(lambda: all(c.done(r) for r in rids + ["bad"]))
        assert c.reason("bad")["type"] == "error" and fired["n"] >= 2
        for rid, w in zip(rids, want):
            assert c.reason(rid)["type"] == "length" and c.ids(rid) == w, rid
    finally:
        e.shutdown()
