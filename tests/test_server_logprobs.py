"""Logprobs, echo and penalties through a real server with the official ``openai`` client: echo
with max_tokens 0 returns the prompt's logprobs (the first null), as lm-eval's loglikelihood
reads them; top alternatives on both routes; penalty fields reach the engine; bad values are
400s naming the field (the tiny model behind a server on 127.0.0.1)."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import torch  # noqa: E402

from blockspec import Engine  # noqa: E402
from blockspec.server.launch import ServerThread  # noqa: E402
from blockspec.tiny_model import write_tiny_model  # noqa: E402

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("server_logprobs") / "tiny")
    engine = Engine(model_path=str(folder), device="cpu")
    server = ServerThread(engine, served_model_name="tiny")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield client, server.url, engine
    server.stop()
    engine.shutdown()


def test_echo_with_max_tokens_0_returns_the_prompt_logprobs(served):
    client, _, engine = served
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    c = r.choices[0]
    ids = engine.tokenizer.encode(PROMPT)
    lp = c.logprobs
    assert c.text == PROMPT and r.usage.completion_tokens == 0
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == PROMPT and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    lsm = torch.log_softmax(engine.runner.score([ids])[0].float(), dim=-1)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(lsm[i - 1, ids[i]])) < 1e-4
        top = lp.top_logprobs[i]
        assert 1 <= len(top) <= 3 and lp.token_logprobs[i] <= max(top.values()) + 1e-6
        assert abs(max(top.values()) - float(lsm[i - 1].max())) < 1e-4


def test_echo_with_one_token_puts_the_prompt_first(served):
    """lm-eval's local-completions call: echo, max_tokens 1, logprobs 1, temperature 0."""
    client, url, engine = served
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
                                      logprobs=1)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
                                  echo=True, logprobs=1)
    c = r.choices[0]
    n = len(engine.tokenizer.encode(PROMPT))
    assert c.text == PROMPT + plain.choices[0].text
    assert len(c.logprobs.token_logprobs) == n + 1
    # the prefill scores the completion's token, the decode step sampled it: two kernels,
    # so equal to fp32 rounding
    assert c.logprobs.token_logprobs[n] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs[0], abs=1e-5)
    echoed, sampled = c.logprobs.top_logprobs[n], plain.choices[0].logprobs.top_logprobs[0]
    assert list(echoed) == list(sampled)
    assert list(echoed.values()) == pytest.approx(list(sampled.values()), abs=1e-5)
    # streamed, the echo comes first and the chunks add up to the same text
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True,
            "stream": True}) as s:
        chunks = [line[6:] for line in s.iter_lines() if line.startswith("data: {")]
    texts = [json.loads(ch)["choices"][0]["text"] for ch in chunks]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert texts[0].startswith(PROMPT) and "".join(texts) == PROMPT + whole.choices[0].text


def test_completion_top_logprobs(served):
    client, _, _ = served
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=4, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4
        assert abs(chosen - max(top.values())) < 1e-6          # greedy: the chosen is the best


def test_chat_top_logprobs(served):
    client, _, _ = served
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0.8, seed=1, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        alts = entry.top_logprobs
        assert len(alts) == 3
        vals = [a.logprob for a in alts]
        assert vals == sorted(vals, reverse=True) and entry.logprob <= vals[0] + 1e-6
        same = [a for a in alts if a.token == entry.token and "\ufffd" not in a.token]
        assert not same or same[0].logprob == entry.logprob


def test_penalties_reach_the_engine(served):
    client, _, engine = served
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    plain = client.completions.create(**kw).choices[0].text
    pen = client.completions.create(**kw, frequency_penalty=2.0, presence_penalty=1.0,
                                    extra_body={"repetition_penalty": 1.8}).choices[0].text
    assert pen != plain
    ids = engine.tokenizer.encode(PROMPT)
    first = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    banned = first["output_ids"][0]
    biased = client.completions.create(**{**kw, "max_tokens": 1}, logit_bias={str(banned): -100},
                                       logprobs=0)
    assert engine.tokenizer.encode(PROMPT + biased.choices[0].text)[len(ids):] != [banned]
    eos_first = client.completions.create(**kw, extra_body={"min_tokens": 5, "stop_token_ids": [banned]})
    assert eos_first.usage.completion_tokens >= 5


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"logprobs": 21}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logit_bias": {"100000000": 1.0}}, "logit_bias"),
    ("chat", {"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ("completions", {"logit_bias": {"3": 101.0}}, "logit_bias"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
])
def test_bad_values_are_400s_naming_the_field(served, route, body, param):
    _, url, _ = served
    req = {"model": "tiny", "max_tokens": 2, **body}
    req.update({"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"})
    r = httpx.post(f"{url}/v1/{'chat/' if route == 'chat' else ''}completions", json=req, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_lm_eval_loglikelihood_reads_what_it_expects(served):
    """lm-eval's local-completions loglikelihood: token-id prompts context + continuation, echo,
    max_tokens 1, logprobs 1; it sums token_logprobs[ctxlen:-1] and calls the continuation
    greedy when each equals the best of its top_logprobs."""
    client, _, engine = served
    ctx = engine.tokenizer.encode(PROMPT)
    greedy = engine.generate(input_ids=ctx, sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                              "ignore_eos": True})["output_ids"]
    other = [(t + 1) % engine.config.vocab_size for t in greedy]
    r = client.completions.create(model="tiny", prompt=[ctx + greedy, ctx + other], max_tokens=1,
                                  temperature=0, logprobs=1, echo=True, seed=1234)
    lsm = torch.log_softmax(engine.runner.score([ctx + other])[0].float(), dim=-1)
    results = []
    for choice, cont in zip(sorted(r.choices, key=lambda c: c.index), (greedy, other)):
        lp = choice.logprobs
        span = lp.token_logprobs[len(ctx):-1]
        assert len(span) == len(cont)
        results.append((sum(span), all(t == max(top.values())
                                       for t, top in zip(span, lp.top_logprobs[len(ctx):-1]))))
    assert results[0][1] and not results[1][1]
    want = sum(float(lsm[len(ctx) + j - 1, t]) for j, t in enumerate(other))
    assert abs(results[1][0] - want) < 1e-3


def test_chat_logprob_bytes_rebuild_the_message(served):
    """Every content entry has its token's bytes (a token that is part of a character too),
    and they concatenate to the message's UTF-8."""
    client, _, _ = served
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "é"}],
                                       max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    entries = r.choices[0].logprobs.content
    assert all(e.bytes is not None for e in entries)
    assert all(a.bytes is not None for e in entries for a in e.top_logprobs)
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == \
        r.choices[0].message.content
