"""``blockspec serve`` end to end: one real server on 127.0.0.1 per module (the demo model, an API
key set), talked to with the official ``openai`` client and raw httpx where the wire matters."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from blockspec import Engine  # noqa: E402
from blockspec.server.launch import ServerThread  # noqa: E402

KEY = "sk-test-key"
MODEL = "demo"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
OFFLINE = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def offline(tiny_folder):
    e = Engine(model_path=str(tiny_folder), device="cpu")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def served(tiny_folder):
    engine = Engine(model_path=str(tiny_folder), device="cpu", max_running_requests=32)
    server = ServerThread(engine, api_key=KEY, served_model_name=MODEL, max_request_bytes=256 * 1024)
    yield server.url, engine, server
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(url, path, body=None, *, key=KEY, raw=None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(url + path, content=raw, headers=headers, timeout=60, **kw)
    return httpx.post(url + path, json=body, headers=headers, timeout=60, **kw)


def _metric(url, name, labels=""):
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _sse_events(lines):
    """Decoded ``data:`` payloads of an SSE body; the literal [DONE] stays a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- results ---------------------------------------------------------------------------------
def test_completions_stream_equals_blocking_equals_offline(client, offline):
    prompts = ["Hello", "The capital of France is"]
    want = offline.generate(prompt=prompts, sampling_params={**OFFLINE, "max_new_tokens": 20})
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, **GREEDY)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [w["text"] for w in want]
    assert all(c.finish_reason == "length" for c in got.choices)
    assert got.usage.completion_tokens == 40
    assert got.usage.prompt_tokens == sum(w["meta_info"]["prompt_tokens"] for w in want)
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, stream=True, **GREEDY)
    texts, reasons, chunks = ["", ""], [None, None], 0
    for chunk in stream:
        chunks += 1
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert chunks > 4 and texts == [w["text"] for w in want] and reasons == ["length", "length"]


def test_token_id_prompts_and_logprobs(client, offline):
    ids = [[5, 17, 33, 8], [44, 3, 9]]
    want = offline.generate(input_ids=ids, sampling_params={**OFFLINE, "max_new_tokens": 8},
                            return_logprob=True)
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, logprobs=0, **GREEDY)
    assert one.choices[0].text == want[0]["text"]
    lps = one.choices[0].logprobs.token_logprobs
    assert lps == pytest.approx([lp for lp, _ in want[0]["meta_info"]["output_token_logprobs"]], abs=1e-5)
    streamed = [lp for chunk in client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8,
                                                          logprobs=0, stream=True, **GREEDY)
                for lp in chunk.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lps, abs=1e-6)
    both = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY)
    assert [c.text for c in both.choices] == [w["text"] for w in want]


def test_n_samples_seeded_and_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=12, temperature=0.9, n=3, seed=11,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2] and a.usage.completion_tokens == 36
    assert [c.text for c in a.choices] == [c.text for c in b.choices]        # same seed, same text
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len("Once upon")  # counted once


def test_chat_stream_and_blocking_equal_offline(client, offline, url):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    tok = offline.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages))
    want = offline.generate(input_ids=ids, sampling_params={**OFFLINE, "max_new_tokens": 16})
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, **GREEDY)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 16
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    # on the wire: SSE that ends with data: [DONE]
    with httpx.stream("POST", url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])


def test_models_health_and_metrics(client, url):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}      # no key needed
    text = httpx.get(url + "/metrics", timeout=30).text
    for name in ("blockspec_requests_total", "blockspec_generation_tokens_total",
                 "blockspec_num_queue_reqs", "blockspec_num_running_reqs", "blockspec_cache_usage",
                 "blockspec_time_to_first_token_seconds_bucket",
                 "blockspec_inter_token_latency_seconds_bucket", "blockspec_http_requests_total"):
        assert name in text, name
    assert _metric(url, "blockspec_generation_tokens_total") > 0


def test_native_generate(url, offline):
    want = offline.generate(prompt=["Hi", "Yo"], sampling_params={**OFFLINE, "max_new_tokens": 6})
    r = _post(url, "/generate", {"text": ["Hi", "Yo"], "sampling_params": {**OFFLINE, "max_new_tokens": 6}})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert got[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    with httpx.stream("POST", url + "/generate", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"input_ids": want[0]["output_ids"][:3] + [5], "stream": True, "rid": "native-1",
                            "sampling_params": {**OFFLINE, "max_new_tokens": 5}}) as resp:
        events = _sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert len(last["output_ids"]) == 5 and last["meta_info"]["id"] == "native-1"   # cumulative


# ---- bad input --------------------------------------------------------------------------------
BAD = [
    # (name, path, body or raw bytes, key, status, param, message piece)
    ("malformed JSON", "/v1/completions", b'{"model": "demo", "prompt": ', KEY, 400, None, "not valid JSON"),
    ("not an object", "/v1/completions", b'[1, 2]', KEY, 422, None, ""),
    ("wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, KEY, 422, "max_tokens", "integer"),
    ("wrong type float", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, KEY, 422, "temperature", "number"),
    ("unknown field", "/v1/completions", {"prompt": "hi", "temprature": 0.5}, KEY, 422, "temprature", "unknown field"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, KEY, 422, "prompt", "required"),
    ("bad prompt type", "/v1/completions", {"prompt": {"a": 1}}, KEY, 400, "prompt", "prompt must be"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, KEY, 400, "prompt", "empty"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, KEY, 404, "model", "gpt-9"),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, KEY, 400, "max_tokens", ">= 1"),
    ("max_tokens negative", "/v1/completions", {"prompt": "hi", "max_tokens": -4}, KEY, 400, "max_tokens", ">= 1"),
    ("max_tokens beyond context", "/v1/completions", {"prompt": "hi", "max_tokens": 5000}, KEY, 400,
     "max_tokens", "context"),
    ("temperature < 0", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, KEY, 400, "temperature", ">= 0"),
    ("top_p 0", "/v1/completions", {"prompt": "hi", "top_p": 0.0}, KEY, 400, "top_p", "(0, 1]"),
    ("top_p > 1", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, KEY, 400, "top_p", "(0, 1]"),
    ("top_k 0", "/v1/completions", {"prompt": "hi", "top_k": 0}, KEY, 400, "top_k", "-1"),
    ("n 0", "/v1/completions", {"prompt": "hi", "n": 0}, KEY, 400, "n", "[1, 128]"),
    ("empty stop", "/v1/completions", {"prompt": "hi", "stop": [""]}, KEY, 400, "stop", "empty"),
    ("seed negative", "/v1/completions", {"prompt": "hi", "seed": -1}, KEY, 400, "seed", "2**64"),
    ("logprobs 21", "/v1/completions", {"prompt": "hi", "logprobs": 21}, KEY, 400, "logprobs", "[0, 20]"),
    ("penalty", "/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, KEY, 400, "presence_penalty", "[-2, 2]"),
    ("token id too big", "/v1/completions", {"prompt": [1, 2, 259]}, KEY, 400, "prompt", "[0, 259)"),
    ("token id negative", "/v1/completions", {"prompt": [[1, -3]]}, KEY, 400, "prompt", "[0, 259)"),
    ("prompt longer than context", "/v1/completions", {"prompt": [7] * 4200}, KEY, 400, "prompt", "context"),
    ("text longer than context", "/v1/completions", {"prompt": "x" * 4100}, KEY, 400, "prompt", "context"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, KEY, 400, "messages", "empty"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, KEY, 422,
     "messages[0].role", "'user'"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, KEY, 422, "messages", "list"),
    ("top_logprobs", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "logprobs": True, "top_logprobs": 21}, KEY, 400, "top_logprobs", "[0, 20]"),
    ("stream_options without stream", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, KEY, 400,
     "stream_options", "stream"),
    ("native bad sampling key", "/generate", {"text": "hi", "sampling_params": {"top-p": 0.5}}, KEY, 400,
     "sampling_params", "top-p"),
    ("native both prompts", "/generate", {"text": "hi", "input_ids": [1]}, KEY, 400, "text", "exactly one"),
    ("abort unknown id", "/abort_request", {"rid": "nope"}, KEY, 404, "rid", "nope"),
    ("missing key", "/v1/completions", {"prompt": "hi"}, None, 401, None, "missing API key"),
    ("wrong key", "/v1/completions", {"prompt": "hi"}, "sk-wrong", 401, None, "incorrect API key"),
    ("wrong key beats bad JSON", "/v1/completions", b"{oops", "sk-wrong", 401, None, "incorrect API key"),
    ("body too large", "/v1/completions", {"prompt": "y" * 300_000}, KEY, 413, None, "larger than"),
    ("unknown route", "/v1/embeddings", {"input": "hi"}, KEY, 404, None, "no such route"),
]


def test_bad_input_is_answered_and_survived(served, client, offline):
    url, _, _ = served
    # a request running beside the bad ones, to be unharmed by them
    want = offline.generate(prompt="steady", sampling_params={**OFFLINE, "max_new_tokens": 160})
    beside: dict = {}

    def run():
        s = client.completions.create(model=MODEL, prompt="steady", max_tokens=160, stream=True, **GREEDY)
        beside["text"] = "".join(c.choices[0].text for c in s if c.choices)

    t = threading.Thread(target=run)
    t.start()
    for name, path, body, key, status, param, piece in BAD:
        r = _post(url, path, raw=body, key=key) if isinstance(body, bytes) else _post(url, path, body, key=key)
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, name
        assert err["message"] and piece in err["message"], (name, err)
        if param is not None:
            assert err["param"] == param, (name, err)
    assert httpx.get(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=30).status_code == 405
    chunked = httpx.post(url + "/v1/completions", timeout=60, content=(b"x" * 65536 for _ in range(5)),
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert chunked.status_code == 413, chunked.text          # no Content-Length: counted as it comes
    # the official client raises its typed errors for them
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    # 429: a queue bound the group cannot fit
    app_client = served[2].app.state.client
    app_client.max_queued = 1
    try:
        r = _post(url, "/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    finally:
        app_client.max_queued = None
    t.join(120)
    assert beside.get("text") == want["text"]            # unharmed, and not lost
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    ok = client.completions.create(model=MODEL, prompt="after", max_tokens=3, **GREEDY)
    assert ok.choices[0].finish_reason == "length"


# ---- cancel -----------------------------------------------------------------------------------
def _idle(url, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _metric(url, "blockspec_cache_usage") == 0.0 and _metric(url, "blockspec_num_running_reqs") == 0.0:
            return True
        time.sleep(0.01)
    return False


def test_cancel_by_client_disconnect(url):
    assert _idle(url)
    aborted = _metric(url, "blockspec_requests_total", '{finish_reason="abort"}') or 0.0
    body = {"model": MODEL, "prompt": "tell me everything", "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()          # kept open: leaving the iterator closes the connection
        assert sum(next(lines).startswith("data: ") for _ in range(10)) == 5
        assert _metric(url, "blockspec_cache_usage") > 0
        assert _metric(url, "blockspec_num_running_reqs") == 1.0
        r.close()                       # the client goes away half-way through 3000 tokens
        assert _idle(url)
        lines.close()
    assert _metric(url, "blockspec_requests_total", '{finish_reason="abort"}') == aborted + 1


def test_cancel_by_abort_request(client, url):
    assert _idle(url)
    stream = client.completions.create(model=MODEL, prompt="go on", max_tokens=3000, stream=True, **GREEDY)
    first = next(iter(stream))
    assert _metric(url, "blockspec_cache_usage") > 0
    r = _post(url, "/abort_request", {"rid": first.id})
    assert r.status_code == 200 and r.json() == {"aborted": 1}
    # the abort is answered once the engine has freed the cache: idle at the very next look
    assert _metric(url, "blockspec_cache_usage") == 0.0
    assert _metric(url, "blockspec_num_running_reqs") == 0.0
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "abort"
    assert sum(len(c.choices[0].text) for c in rest) < 3000


def test_cancel_blocking_request_by_disconnect(url):
    assert _idle(url)
    aborted = _metric(url, "blockspec_requests_total", '{finish_reason="abort"}') or 0.0
    with pytest.raises(httpx.ReadTimeout):      # the client gives up and closes the connection
        httpx.post(url + "/v1/completions", timeout=httpx.Timeout(60, read=0.5),
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "wait", "max_tokens": 3000, "ignore_eos": True})
    assert _idle(url)
    assert _metric(url, "blockspec_requests_total", '{finish_reason="abort"}') == aborted + 1


# ---- load -------------------------------------------------------------------------------------
def test_load_200_concurrent_short_requests(url):
    from blockspec.bench.serve_load import run_load

    result = asyncio.run(run_load(url, requests=200, max_tokens=8, api_key=KEY, model=MODEL))
    assert result["errors"] == 0, result["error_samples"]
    assert result["completed"] == 200 and result["short_outputs"] == 0
    assert result["latency_p50_s"] <= result["latency_p99_s"] and result["output_tok_per_s"] > 0
    assert _idle(url)
