"""The engine loop: streamed deltas equal the blocking result, stop strings and multi-byte
characters are never split, abort frees the cache before the next step, prefill chunks
interleave with decode steps, requests queue for capacity, and a failed step fails only the
requests it held."""
from __future__ import annotations

import threading

import pytest

from blockspec import Engine
from blockspec.engine.stop import IncrementalDetokenizer, held_back
from blockspec.sampling import SamplingParams
from tests.polling import wait_until  # noqa: E402

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_folder):
    e = Engine(model_path=str(tiny_folder), device="cpu")
    yield e
    e.shutdown()


def test_stream_deltas_concatenate_to_the_blocking_result(engine):
    prompts = ["Hello", "Ünïcödé → ✓", "a"]
    want = engine.generate(prompt=prompts, sampling_params=GREEDY, return_logprob=True)
    chunks = list(engine.generate(prompt=prompts, sampling_params=GREEDY, return_logprob=True,
                                  stream=True))
    for i, w in enumerate(want):
        mine = [c for c in chunks if c["index"] == i]
        assert len(mine) > 1                                     # it did stream
        assert "".join(c["text"] for c in mine) == w["text"]
        assert [t for c in mine for t in c["output_ids"]] == w["output_ids"]
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
        assert mine[-1]["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]
        assert all(c["meta_info"]["finish_reason"] is None for c in mine[:-1])
    single = list(engine.generate(prompt="Hello", sampling_params=GREEDY, stream=True))
    assert "index" not in single[0] and "".join(c["text"] for c in single) == want[0]["text"]


def test_detokenizer_never_splits_a_character(engine):
    tok = engine.tokenizer
    text = "héllo wörld ✓ 😀 done"
    ids = tok.encode(text)
    assert len(ids) > len(text)                    # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok.decode)
    deltas = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish(text) == text
    assert "".join(deltas) == text


def test_detokenizer_holds_back_a_possible_stop_string(engine):
    tok = engine.tokenizer
    text = "one two three"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok.decode, ["two!", "xyz"])
    shown = ""
    for i in range(len(ids)):
        shown += detok.step(ids[: i + 1])
        so_far = tok.decode(ids[: i + 1])
        assert so_far.startswith(shown)
        assert not shown.endswith(("t", "tw", "two"))    # could still become "two!"
    assert shown + detok.finish(text) == text
    assert held_back("abc tw", ["two!"]) == 2 and held_back("abc", ["two!"]) == 0
    assert held_back("xx", ["xxy", "xy"]) == 2


def test_streamed_stop_string_is_never_shown(engine):
    sp = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    text = engine.generate(prompt="Hello", sampling_params=sp)["text"]
    clean = [i for i in range(2, len(text) - 3) if "\ufffd" not in text[i:i + 3]]
    at = clean[len(clean) // 2]
    stop = text[at:at + 3]
    want = engine.generate(prompt="Hello", sampling_params={**sp, "stop": stop})
    assert want["text"] == text[: text.find(stop)]
    chunks = list(engine.generate(prompt="Hello", sampling_params={**sp, "stop": stop}, stream=True))
    streamed = ""
    for c in chunks:
        streamed += c["text"]
        assert stop not in streamed and streamed == want["text"][: len(streamed)]
    assert streamed == want["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def _submit(engine, ids, sp, outs, **kw):
    return engine.submit(ids, SamplingParams.from_dict(sp), outs.append, **kw)


def test_abort_frees_cache_before_the_next_step(engine):
    outs: list = []
    rid = _submit(engine, [5, 6, 7], {**GREEDY, "max_new_tokens": 2000}, outs)
    wait_until(lambda: len(outs) >= 3)
    assert engine.stats().cache_usage > 0 and engine.stats().running == 1
    before = engine.stats().steps
    assert engine.abort(rid, wait=10)
    s = engine.stats()
    assert s.cache_usage == 0.0 and s.running == 0 and s.waiting == 0
    assert s.steps - before <= 1                      # freed within one step
    last = outs[-1]
    assert last.finished and last.finish_reason["type"] == "abort"
    got = sum(len(o.token_ids) for o in outs)
    assert 3 <= got < 2000 and last.meta_info["completion_tokens"] == got
    assert not engine.abort(rid)                      # gone


def test_closing_a_stream_aborts_it(engine):
    it = engine.generate(input_ids=[9, 8, 7], sampling_params={**GREEDY, "max_new_tokens": 2000},
                         stream=True)
    for _, _chunk in zip(range(3), it):
        pass
    assert engine.stats().running == 1
    it.close()
    wait_until(lambda: engine.stats().running == 0 and engine.stats().cache_usage == 0.0)


def test_new_requests_join_while_others_stream(engine):
    """Continuous batching, and prefill chunks interleaved with decode steps: a long prompt
    prefilled in many chunks does not stall a running stream."""
    e = Engine(model_path=engine.args.model_path, device="cpu", chunked_prefill_size=4)
    try:
        events: list[tuple[str, int]] = []
        lock = threading.Lock()

        def sink(name):
            def put(out):
                with lock:
                    events.append((name, list(out.token_ids)))
            return put

        a = e.submit([3, 4, 5], SamplingParams.from_dict({**GREEDY, "max_new_tokens": 300}), sink("a"))
        wait_until(lambda: len(events) >= 2)
        long_prompt = [(7 * i) % 250 + 3 for i in range(64)]          # 16 prefill chunks of 4
        e.submit(long_prompt, SamplingParams.from_dict({**GREEDY, "max_new_tokens": 4}), sink("b"))
        wait_until(lambda: any(n == "b" for n, _ in events))
        with lock:
            start = next(i for i, (n, _) in enumerate(events) if n == "b")
            a_before_b = sum(1 for n, k in events[:start] if n == "a" and k)
        assert a_before_b >= 2 + 15       # a decoded beside every prefill chunk of b
        e.abort(a, wait=10)
        ref = engine.generate(input_ids=long_prompt, sampling_params={**GREEDY, "max_new_tokens": 4})
        wait_until(lambda: e.stats().running == 0)
        with lock:
            assert [t for n, ids in events if n == "b" for t in ids] == ref["output_ids"]
    finally:
        e.shutdown()


def test_prefill_chunks_shrink_while_others_decode(engine):
    """A prompt prefills in chunks of decoding_prefill_chunk_size while another request
    decodes (each chunk delays that stream by one forward) and of chunked_prefill_size when
    nothing decodes; the tokens are the same either way."""
    e = Engine(model_path=engine.args.model_path, device="cpu", chunked_prefill_size=32,
               decoding_prefill_chunk_size=8)
    sizes: list[int] = []
    extend = e.runner.extend

    def recording(slots, starts, tokens, **kw):
        sizes.extend(len(t) for t in tokens)
        return extend(slots, starts, tokens, **kw)

    e.runner.extend = recording
    try:
        long_prompt = [(5 * i) % 250 + 3 for i in range(64)]
        sp = {**GREEDY, "max_new_tokens": 4}
        alone = e.generate(input_ids=long_prompt, sampling_params=sp)["output_ids"]
        assert sizes == [32, 32]
        outs: list = []
        a = _submit(e, [3, 4, 5], {**GREEDY, "max_new_tokens": 300}, outs)
        wait_until(lambda: len(outs) >= 2)
        sizes.clear()
        beside = e.generate(input_ids=long_prompt, sampling_params=sp)["output_ids"]
        assert sizes == [8] * 8
        assert beside == alone
        e.abort(a, wait=10)
    finally:
        e.shutdown()


def test_requests_wait_for_capacity_and_all_complete(tiny_folder, engine):
    small = Engine(model_path=str(tiny_folder), device="cpu", max_total_tokens=96, page_size=8,
                   max_running_requests=8)
    try:
        prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
        sp = {**GREEDY, "max_new_tokens": 40}        # 3 + 40 tokens: 6 blocks; 2 fit at once
        seen_waiting = []
        it = small.generate(input_ids=prompts, sampling_params=sp, stream=True)
        chunks = []
        for c in it:
            chunks.append(c)
            seen_waiting.append(small.stats().waiting)
        assert max(seen_waiting) >= 4
        want = engine.generate(input_ids=prompts, sampling_params=sp)
        for i, w in enumerate(want):
            assert [t for c in chunks if c["index"] == i for t in c["output_ids"]] == w["output_ids"]
    finally:
        small.shutdown()


def test_seeded_request_joining_a_running_batch_matches_alone(engine):
    sp = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 77, "ignore_eos": True}
    alone = engine.generate(input_ids=[40, 41, 42], sampling_params=sp)["output_ids"]
    outs: list = []
    others = [_submit(engine, [i + 3, i + 4], {"max_new_tokens": 300, "temperature": 1.0,
                                               "ignore_eos": True}, outs) for i in range(3)]
    wait_until(lambda: len(outs) >= 6)
    joined = engine.generate(input_ids=[40, 41, 42], sampling_params=sp)["output_ids"]
    for rid in others:
        engine.abort(rid, wait=10)
    assert joined == alone


def test_failed_step_fails_its_requests_and_the_loop_carries_on(tiny_folder):
    e = Engine(model_path=str(tiny_folder), device="cpu")
    try:
        real = e.scheduler.step
        calls = {"n": 0}

        def flaky():
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected failure")
            return real()

        e.scheduler.step = flaky
        with pytest.raises(RuntimeError, match="injected failure"):
            e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
        assert e.stats().cache_usage == 0.0 and e.stats().running == 0   # published before
        out = e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
        assert len(out["output_ids"]) == 24
    finally:
        e.shutdown()


def test_shutdown_ends_running_streams(tiny_folder):
    e = Engine(model_path=str(tiny_folder), device="cpu")
    it = e.generate(input_ids=[4, 5], sampling_params={**GREEDY, "max_new_tokens": 4000}, stream=True)
    next(it)
    threading.Timer(0.05, e.shutdown).start()
    with pytest.raises(RuntimeError, match="shut down"):
        for _ in it:
            pass
    with pytest.raises(ValueError, match="shut down"):
        e.generate(input_ids=[1])


def test_a_crashed_loop_ends_its_requests_instead_of_hanging(tiny_folder):
    e = Engine(model_path=str(tiny_folder), device="cpu")
    try:
        def broken(changed):
            raise KeyError("a bug in the loop itself")

        e._loop._emit = broken
        with pytest.raises(RuntimeError, match="engine loop crashed: KeyError"):
            e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
        assert not e.stats().alive and e.stats().cache_usage == 0.0
        with pytest.raises(ValueError, match="crashed"):
            e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    finally:
        e.shutdown()
