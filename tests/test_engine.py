"""Engine behaviour: batch invariance, chunked prefill, sampling controls, tokenizer, stops."""
from __future__ import annotations

import pytest

from blockspec import Engine
from blockspec.tiny_model import write_tiny_model
from tests.hf_oracle import make_checkpoint

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 17, 33, 8, 60, 21, 9, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [44, 3],
           [12, 70, 71, 72, 15], [88, 10, 23, 54, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    _, f = make_checkpoint("basic", tmp_path_factory.mktemp("eng"))
    return f


@pytest.fixture(scope="module")
def engine(folder):
    e = Engine(model_path=str(folder), dtype="float32", device="cpu")
    yield e
    e.shutdown()


def test_greedy_batch_invariance(engine):
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    batched = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert alone == batched


def test_seeded_sampling_same_alone_or_batched(engine):
    sp = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
    alone = engine.generate(input_ids=PROMPTS[1], sampling_params=sp)["output_ids"]
    mixed = engine.generate(input_ids=PROMPTS, sampling_params=[
        {**sp, "seed": 7}, sp, {"temperature": 1.0, "max_new_tokens": 16}, GREEDY])
    assert mixed[1]["output_ids"] == alone
    again = engine.generate(input_ids=PROMPTS[1], sampling_params={**sp, "seed": 1235})["output_ids"]
    assert again != alone  # a different seed gives a different draw (16 tokens, vocab 96)


def test_chunked_prefill_equals_one_shot(folder, engine):
    one_shot = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    chunked = Engine(model_path=str(folder), dtype="float32", device="cpu", chunked_prefill_size=3)
    try:
        got = chunked.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in one_shot]
        again = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        for a, b in zip(got, again):   # the first token's logprob comes from the last prefill chunk
            assert a["meta_info"]["output_token_logprobs"][0][0] == pytest.approx(
                b["meta_info"]["output_token_logprobs"][0][0], abs=1e-5)
    finally:
        chunked.shutdown()


def test_small_cache_queues_requests(folder):
    e = Engine(model_path=str(folder), dtype="float32", device="cpu", max_total_tokens=48,
               page_size=4, max_running_requests=2)
    ref = Engine(model_path=str(folder), dtype="float32", device="cpu")
    got = e.generate(input_ids=PROMPTS[1:], sampling_params=GREEDY)
    want = ref.generate(input_ids=PROMPTS[1:], sampling_params=GREEDY)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    with pytest.raises(ValueError, match="max_total_tokens"):
        e.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 40})


def test_stop_token_ids_max_new_tokens_and_logprobs(engine):
    base = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY, return_logprob=True)
    ids = base["output_ids"]
    lps = base["meta_info"]["output_token_logprobs"]
    assert [t for _, t in lps] == ids and all(lp <= 0.0 for lp, _ in lps)
    stop_at = ids[5]
    first = ids.index(stop_at)
    out = engine.generate(input_ids=PROMPTS[2], sampling_params={**GREEDY, "stop_token_ids": [stop_at]})
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    zero = engine.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


def test_eos_stops_unless_ignored(engine):
    ids = engine.generate(input_ids=PROMPTS[3], sampling_params=GREEDY)["output_ids"]
    eos = ids[3]
    engine.scheduler.eos.add(eos)
    try:
        out = engine.generate(input_ids=PROMPTS[3], sampling_params={**GREEDY, "ignore_eos": False})
        assert out["output_ids"] == ids[: ids.index(eos) + 1]
        kept = engine.generate(input_ids=PROMPTS[3], sampling_params=GREEDY)
        assert kept["output_ids"] == ids
    finally:
        engine.scheduler.eos.discard(eos)


def test_text_prompts_chat_tokenizer_and_stop_strings(tmp_path):
    folder = write_tiny_model(tmp_path / "demo")
    e = Engine(model_path=str(folder), device="cpu")
    out = e.generate(prompt="Hello", sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                    "ignore_eos": True})
    assert out["meta_info"]["prompt_tokens"] == 5
    assert out["text"] == e.tokenizer.decode(out["output_ids"])
    text = out["text"]
    cut = next(i for i in range(1, len(text)) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    stop = text[cut:cut + 2]
    stopped = e.generate(prompt="Hello", sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                        "ignore_eos": True, "stop": stop})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == text[: text.find(stop)]
    both = e.generate(prompt=["a", "bc"], sampling_params={"max_new_tokens": 2})
    assert isinstance(both, list) and len(both) == 2
    assert "Hello" in e.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])


def test_meta_info_timing_and_step_hook(engine):
    from blockspec.progress import TokenProgress

    seen = []
    progress = TokenProgress(enabled=True, delay=0.0)
    engine.on_step = lambda done, total: (seen.append((done, total)), progress(done, total))
    try:
        outs = engine.generate(input_ids=[[3, 4, 5], [6, 7]],
                               sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    finally:
        engine.on_step = None
    total = 3 + 2 + 2 * 5
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1] == (total, total)
    assert len(seen) >= 5 and all(t == total for _, t in seen)     # one call per output
    assert progress.bar.n == progress.bar.total == total
    progress.close()
    for o in outs:
        meta = o["meta_info"]
        assert 0 < meta["ttft"] <= meta["e2e_latency"]
        assert meta["output_throughput"] == pytest.approx(5 / meta["e2e_latency"])


def test_steps_overlap_and_finished_rows_are_dropped(engine, monkeypatch):
    """While the running requests stay the same, each step is launched from the inputs the
    previous one advanced on the device (a continuation), before the previous one is read
    back; a request that finishes is computed one step too far and that row is dropped, so
    every request still gets exactly its own tokens, and the cache reserves two steps."""
    from blockspec.runtime.model_runner import ModelRunner

    kinds = []
    orig = ModelRunner.launch_step
    monkeypatch.setattr(ModelRunner, "launch_step",
                        lambda self, batch, *a, **kw: kinds.append(batch is None)
                        or orig(self, batch, *a, **kw))
    lens = [3, 9, 5, 14]
    sp = [{**GREEDY, "max_new_tokens": n} for n in lens]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=sp)
    assert [len(o["output_ids"]) for o in outs] == lens
    assert kinds.count(True) >= 8 and kinds.count(False) >= 3     # continued, refilled on finishes
    monkeypatch.setattr(ModelRunner, "launch_step", orig)
    for o, p, n in zip(outs, PROMPTS, lens):        # alone, each request decodes the same tokens
        assert engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": n}
                               )["output_ids"] == o["output_ids"]
    assert engine.memory.lookahead == 2 * engine.memory.step_width == 2


def test_equal_chunks_apart_share_one_scan_and_match_alone(engine):
    """Prompts of lengths 4, 2, 4 in one prefill: the two 4-token chunks (not neighbours)
    run one Mamba scan through a row index, the 2-token one alone as a view; every output
    equals its prompt decoded alone."""
    from blockspec.forward_metadata import ForwardMetadata

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]
    seen = []
    groups = ForwardMetadata.extend_groups

    def recording(meta):
        out = groups(meta)
        seen.append([(g.q, g.n, g.rows is None) for g in out])
        return out

    ForwardMetadata.extend_groups = recording
    try:
        batched = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    finally:
        ForwardMetadata.extend_groups = groups
    assert [(4, 2, False), (2, 1, True)] in seen
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert batched == alone
