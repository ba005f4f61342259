"""One boundary for every way in: the offline Engine, the CLI and the server refuse the same
values (ranges the step buffers hold, the vocabulary, the model's context, UTF-8 text) with an
error naming the field and the range, and an error never costs a client its connection."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from blockspec import Engine
from blockspec.engine.engine import GenerateError
from blockspec.sampling import SamplingParamsError

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from blockspec.server.launch import ServerThread  # noqa: E402

SP = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_folder):
    e = Engine(model_path=str(tiny_folder), device="cpu")
    yield e
    e.shutdown()


# ---- the offline Engine ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, param, piece", [
    ({"prompt": "\ud800"}, GenerateError, "prompt", "not UTF-8"),
    ({"prompt": ["ok", "a\udcffb"]}, GenerateError, "prompt[1]", "character 1"),
    ({"prompt": "hi", "sampling_params": {**SP, "stop": ["x\ud800"]}}, SamplingParamsError,
     "stop", "stop[0] is not UTF-8"),
    ({"input_ids": [1, 2], "sampling_params": {**SP, "top_k": 2**63}}, SamplingParamsError,
     "top_k", "2**31 - 1"),
    ({"input_ids": [1, 2], "sampling_params": {**SP, "seed": 2**64}}, SamplingParamsError,
     "seed", "[0, 2**64)"),
    ({"input_ids": [1, 2], "sampling_params": {**SP, "temperature": 1e39}}, SamplingParamsError,
     "temperature", "float32"),
    ({"input_ids": [1, 2], "sampling_params": {**SP, "temperature": 10**400}},
     SamplingParamsError, "temperature", "finite"),
    ({"input_ids": [1, 2], "sampling_params": {**SP, "stop_token_ids": [99999]}}, GenerateError,
     "stop_token_ids", "[0, 259)"),
    ({"input_ids": [1, 2**200]}, GenerateError, "input_ids", "an int of 201 bits"),
    ({"input_ids": [[1, 2], [3, 300]]}, GenerateError, "input_ids[1]", "[0, 259)"),
    ({"input_ids": []}, GenerateError, "input_ids", "non-empty"),
    ({"prompt": []}, GenerateError, "prompt", "non-empty"),
])
def test_engine_refuses_with_the_field_named(engine, kwargs, error, param, piece):
    with pytest.raises(error) as info:
        engine.generate(**kwargs)
    assert isinstance(info.value, ValueError) and not isinstance(info.value, TypeError)
    assert info.value.param == param and piece in str(info.value), (info.value.param, info.value)
    assert engine.stats().waiting == 0 and engine.stats().running == 0     # nothing queued


def test_values_the_engine_represents_still_run(engine):
    ids = [5, 6, 7]
    greedy = engine.generate(input_ids=ids, sampling_params=SP)["output_ids"]
    # a temperature whose reciprocal overflows float32 is greedy, not NaN sampling
    assert engine.generate(input_ids=ids, sampling_params={**SP, "temperature": 1e-45}
                           )["output_ids"] == greedy
    sampled = {**SP, "temperature": 0.9, "seed": 2**64 - 1}
    off = engine.generate(input_ids=ids, sampling_params={**sampled, "top_k": -1})
    wide = engine.generate(input_ids=ids, sampling_params={**sampled, "top_k": 2**31 - 1})
    assert wide["output_ids"] == off["output_ids"]          # top_k past the vocabulary: all kept


def test_context_length_is_enforced_offline_naming_both_numbers(engine, tiny_folder):
    with pytest.raises(GenerateError) as info:
        engine.generate(input_ids=[1, 2], sampling_params={**SP, "max_new_tokens": 5000})
    msg = str(info.value)
    assert info.value.param == "max_new_tokens"
    assert "2 tokens" in msg and "5000" in msg and "4096" in msg and "max_position_embeddings" in msg
    assert "max_total_tokens" not in msg
    with pytest.raises(GenerateError) as info:          # the prompt alone is past the context
        engine.generate(input_ids=[7] * 5000, sampling_params=SP)
    assert info.value.param == "input_ids" and "5000 tokens" in str(info.value)
    assert "4096" in str(info.value) and "max_total_tokens" not in str(info.value)
    small = Engine(model_path=str(tiny_folder), device="cpu", max_total_tokens=256)
    try:            # within the context but not the cache: raising the cache can work
        with pytest.raises(GenerateError) as info:
            small.generate(input_ids=[1, 2], sampling_params={**SP, "max_new_tokens": 1000})
        assert "raise max_total_tokens to at least 1004" in str(info.value)
    finally:
        small.shutdown()


def test_missing_tokenizer_path_is_named(tiny_folder, tmp_path):
    with pytest.raises(GenerateError, match="tokenizer_path /nonexistent does not exist"):
        Engine(model_path=str(tiny_folder), device="cpu", tokenizer_path="/nonexistent")
    with pytest.raises(GenerateError, match="has no tokenizer.json"):
        Engine(model_path=str(tiny_folder), device="cpu", tokenizer_path=str(tmp_path))


# ---- the CLI: one line, exit 2 -----------------------------------------------------------------
def test_cli_errors_stay_one_line(tiny_folder):
    base = [sys.executable, "-m", "blockspec.cli", "generate", "--model-path", str(tiny_folder),
            "--device", "cpu", "--max-new-tokens", "2"]
    cases = [
        (base + [b"caf\xff"], "prompt 1 is not UTF-8 text: character 3 is byte 0xff"),
        (base + ["--input-ids", "1,2", "--top-k", "9223372036854775808"], "--top-k: top_k"),
        (base + ["--input-ids", "1,2", "--stop-token-ids", "99999"], "stop_token_ids"),
        (base + ["hi", "--tokenizer-path", "/nonexistent"],
         "tokenizer_path /nonexistent does not exist"),
        (base + ["--input-ids", "1,2", "--max-new-tokens", "5000"], "4096"),
    ]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for args, _ in cases]
    for (args, want), p in zip(cases, procs):
        _, err = p.communicate(timeout=300)
        text = err.decode("utf-8", "replace")
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
        assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in text, (args, text)
        assert lines[0].startswith("blockspec generate: error: ") and want in lines[0], lines
    assert "max_total_tokens" not in text and "--max-total-tokens" not in text


# ---- the server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(engine):
    server = ServerThread(engine, max_request_bytes=1 << 20)
    yield server.url
    server.stop()


def _raw(client, path: str, text: str):
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


CHAT = '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}'
REFUSED = [  # (path, raw JSON body, param, message piece)
    ("/v1/completions", '{"prompt": "hi", "top_k": 9223372036854775808}', "top_k", "2**31 - 1"),
    ("/v1/completions", '{"prompt": "hi", "top_k": 0}', "top_k", "-1"),
    ("/v1/completions", '{"prompt": "hi", "seed": 18446744073709551616}', "seed", "2**64"),
    ("/v1/completions", '{"prompt": "hi", "temperature": 1e39}', "temperature", "3.4e38"),
    ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [99999]}', "stop_token_ids", "[0, 259)"),
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt", "not UTF-8"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt[1]", "not UTF-8"),
    ("/v1/completions", '{"prompt": "hi", "stop": "\\ud800"}', "stop", "not UTF-8"),
    ("/v1/completions", '{"prompt": "hi", "rid": "\\ud800"}', "rid", "not UTF-8"),
    ("/v1/completions", '{"prompt": "hi", "user": "a\\ud800"}', "user", "not UTF-8"),
    ("/v1/chat/completions", CHAT % '"\\ud800"', "messages[0].content", "not UTF-8"),
    ("/v1/chat/completions", CHAT % '[{"type": "text", "text": "\\udc00"}]',
     "messages[0].content[0].text", "not UTF-8"),
    ("/generate", '{"text": "\\ud800"}', "text", "not UTF-8"),
    ("/generate", '{"text": "hi", "rid": "\\ud800"}', "rid", "not UTF-8"),
    ("/generate", '{"text": "hi", "sampling_params": {"stop": "\\ud800"}}',
     "sampling_params.stop", "not UTF-8"),
    ("/generate", '{"text": "hi", "sampling_params": {"top_k": 9223372036854775808}}',
     "sampling_params.top_k", "2**31 - 1"),
    ("/generate", '{"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [99999]}}',
     "sampling_params.stop_token_ids", "[0, 259)"),
    ("/generate", '{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}',
     "sampling_params.max_new_tokens", "4096"),
    ("/abort_request", '{"rid": "\\ud800"}', "rid", "not UTF-8"),
    ("/v1/completions", b'{"prompt": "caf\xff"}'.decode("latin-1"), None, "not UTF-8 JSON"),
]


def test_server_refuses_with_400_naming_the_field_and_keeps_the_connection(served, engine):
    want = engine.generate(input_ids=[3, 4, 5], sampling_params={**SP, "max_new_tokens": 60})
    beside: dict = {}

    def run():   # an innocent request decoding while the bad ones arrive
        with httpx.Client(base_url=served, timeout=120) as c:
            r = c.post("/generate", json={"input_ids": [3, 4, 5],
                                          "sampling_params": {**SP, "max_new_tokens": 60}})
            beside["ids"] = r.json()["output_ids"]

    t = threading.Thread(target=run)
    t.start()
    with httpx.Client(base_url=served, timeout=60,
                      limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as c:
        ports = set()
        for path, body, param, piece in REFUSED:
            raw = body.encode("latin-1") if "\xff" in body else body.encode()
            r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["param"] == param, (body, err)
            assert piece is None or piece in err["message"], (body, err)
            ports.add(r.extensions["network_stream"].get_extra_info("client_addr"))
        ok = c.post("/generate", json={"input_ids": [3, 4, 5], "sampling_params": SP})
        assert ok.status_code == 200
        ports.add(ok.extensions["network_stream"].get_extra_info("client_addr"))
        assert len(ports) == 1                       # every answer on one connection
    t.join(120)
    assert beside["ids"] == want["output_ids"]


class _Exploding:
    """The engine's tokenizer, except that the prompt "boom" raises: an error no handler
    foresaw, to be answered 500."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text: str) -> list[int]:
        if text == "boom":
            raise KeyError("unforeseen")
        return self._tok.encode(text)


def test_a_500_keeps_the_keep_alive_connection_and_every_error_is_openai_shaped(tiny_folder):
    e = Engine(model_path=str(tiny_folder), device="cpu")
    server = ServerThread(e, max_request_bytes=4096)
    e.tokenizer = _Exploding(e.tokenizer)
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as c:
            port = None
            answers = [
                (c.post("/v1/completions", json={"prompt": "boom", "max_tokens": 2}), 500),
                (c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2}), 200),
                (c.post("/v1/completions", json={"prompt": "boom", "max_tokens": 2}), 500),
                (c.get("/v1/completions"), 405),
                (c.delete("/generate"), 405),
                (c.post("/v1/nothing", json={}), 404),
                (c.post("/v1/completions", json={"prompt": 3}), 400),
                (c.post("/v1/completions", json={"prompt": "hi", "n": "two"}), 422),
                (c.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"}), 400),
                (c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2}), 200),
            ]
            for r, status in answers:
                assert r.status_code == status, (r.request.method, r.request.url, r.text)
                here = r.extensions["network_stream"].get_extra_info("client_addr")
                assert port in (None, here), "the connection was dropped"
                port = here
                if status >= 400:
                    assert r.headers["content-type"] == "application/json"
                    err = r.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"} and err["message"]
                if status == 405:
                    assert r.headers["allow"] in ("POST", "GET")
            too_big = c.post("/v1/completions", json={"prompt": "y" * 5000})   # may close
            assert too_big.status_code == 413 and set(too_big.json()["error"]) == {
                "message", "type", "param", "code"}
            assert answers[0][0].json()["error"]["type"] == "server_error"
            assert "KeyError" in answers[0][0].json()["error"]["message"]
    finally:
        server.stop()
        e.shutdown()


def test_openapi_says_what_the_server_accepts_and_answers(served, engine):
    schema = httpx.get(served + "/openapi.json", timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/abort_request"):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "413", "422", "429", "500", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse"), (path, status)
    assert "text/event-stream" in schema["paths"]["/v1/completions"]["post"]["responses"]["200"][
        "content"]
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    got = httpx.get(served + "/metrics", timeout=30).headers["content-type"]
    assert got.split(";")[0] == "text/plain"
    body = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    ints = [s for s in body["top_k"]["anyOf"] if s.get("type") == "integer"]
    assert ints[0]["minimum"] == -1 and ints[0]["maximum"] == 2**31 - 1
    assert body["top_k"]["not"] == {"const": 0}
    ids = body["prompt"]["anyOf"][2]["items"]
    assert ids["minimum"] == 0 and ids["maximum"] == engine.config.vocab_size - 1
    max_tokens = [s for s in body["max_tokens"]["anyOf"] if s.get("type") == "integer"][0]
    # completions take max_tokens 0 with echo (the prompt's logprobs alone); chat never
    assert max_tokens["minimum"] == 0 and max_tokens["maximum"] == engine.context_length - 1
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["max_tokens"]
    chat = [s for s in chat["anyOf"] if s.get("type") == "integer"][0]
    assert chat["minimum"] == 1 and chat["maximum"] == engine.context_length - 1
    seed = [s for s in body["seed"]["anyOf"] if s.get("type") == "integer"][0]
    assert seed["minimum"] == 0 and seed["exclusiveMaximum"] == 2**64
    # 5.0 is an integer to JSON Schema, so the server takes it
    r = httpx.post(served + "/v1/completions", timeout=60, json={
        "prompt": [5.0, 6], "max_tokens": 2.0, "top_k": 3.0, "seed": 4.0, "temperature": 0.5})
    assert r.status_code == 200, r.text
