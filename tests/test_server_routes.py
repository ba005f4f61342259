"""The routes and fields clients probe beside generation: /tokenize and /detokenize (vLLM's
shapes), GET /v1/models/{id}, HEAD, per-chunk usage (stream_options.continuous_usage_stats)
and the OpenAI fields that change nothing (the tiny model behind a real server)."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")



@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0].url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def test_tokenize_and_detokenize_round_trip(http, server):
    engine = server[1]
    r = http.post("/tokenize", json={"prompt": "Once upon a time", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = engine.tokenizer.encode("Once upon a time", add_special_tokens=True)
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == engine.context_length
    assert body["token_strs"] == [engine.tokenizer.piece(t) for t in want]
    r = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": engine.tokenizer.decode(want)}


def test_tokenize_messages_counts_the_chat_prompt(http, client):
    """/tokenize of messages gives the prompt the chat route feeds the model."""
    messages = [{"role": "user", "content": "Hi there"}]
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
])
def test_tokenize_bad_input_names_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_model_by_id_and_head(http, client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    for path in ("/v1/models", "/v1/models/tiny", "/health", "/metrics"):
        r = http.head(path)
        assert r.status_code == 200 and r.content == b"", path


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_in_every_chunk(client, route):
    kw = dict(model="tiny", max_tokens=6, temperature=0, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True},
              extra_body={"ignore_eos": True})
    if route == "completions":
        chunks = list(client.completions.create(prompt="Once upon", **kw))
    else:
        chunks = list(client.chat.completions.create(
            messages=[{"role": "user", "content": "Hi"}], **kw))
    body, last = chunks[:-1], chunks[-1]
    assert body and all(c.usage is not None for c in body)
    counts = [c.usage.completion_tokens for c in body]
    assert counts == sorted(counts) and counts[-1] == 6           # so far, growing to the end
    assert len({c.usage.prompt_tokens for c in body}) == 1
    assert last.choices == [] and last.usage.completion_tokens == 6


def test_fields_that_change_nothing_are_accepted(client):
    kw = dict(model="tiny", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt="Once upon", **kw).choices[0].text
    noisy = client.completions.create(prompt="Once upon", user="u1", model="tiny", max_tokens=5,
                                      temperature=0, extra_body={
                                          "ignore_eos": True, "store": False,
                                          "metadata": {"k": "v"}, "service_tier": "auto"})
    assert noisy.choices[0].text == plain
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                          user="u1", store=False, metadata={"k": "v"},
                                          service_tier="auto", parallel_tool_calls=False, **kw)
    assert chat.choices[0].finish_reason == "length"
