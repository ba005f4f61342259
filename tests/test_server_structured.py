"""Structured output over HTTP: OpenAI's ``response_format`` (text, json_object, json_schema) and
sglang's ``regex`` / ``ebnf`` through the official ``openai`` client against a real server on
127.0.0.1 (the demo family with DFlash), equal to the offline engine without speculation; a bad
grammar is a 400 naming its field and the server keeps serving."""
from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from blockspec import Engine  # noqa: E402
from blockspec.demo_family import EXAMPLE_QUESTION  # noqa: E402
from blockspec.server.launch import ServerThread  # noqa: E402
from tests.test_structured import SCHEMA  # noqa: E402

MODEL = "demo"
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def served():
    engine = Engine(device="cpu", dtype="float32")                  # DFLASH by default
    offline = Engine(device="cpu", dtype="float32", speculative_algorithm="NONE")
    server = ServerThread(engine, served_model_name=MODEL)
    yield server.url, offline
    server.stop()
    engine.shutdown()
    offline.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=300)


def _offline(offline: Engine, constraint: dict, chat: bool = True, max_tokens: int = 48) -> str:
    tok = offline.tokenizer
    text = (tok.apply_chat_template([{"role": "user", "content": EXAMPLE_QUESTION}]) if chat
            else EXAMPLE_QUESTION)
    return offline.generate(prompt=text, sampling_params={
        "max_new_tokens": max_tokens, "temperature": 0, **constraint})["text"]


def test_chat_json_schema_blocking_and_streaming(client, served):
    msgs = [{"role": "user", "content": EXAMPLE_QUESTION}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48,
                                       response_format=FORMAT)
    content = r.choices[0].message.content
    obj = json.loads(content)
    assert set(obj) == {"answer", "unit"} and isinstance(obj["answer"], int)
    assert r.choices[0].finish_reason == "stop"
    assert content == _offline(served[1], {"json_schema": SCHEMA})
    stream = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48,
                                            response_format=FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content


def test_chat_json_object_and_text(client, served):
    msgs = [{"role": "user", "content": EXAMPLE_QUESTION}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content == _offline(served[1], {"json_object": True})
    plain = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=24)
    text = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=24,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("body, check, constraint", [
    ({"response_format": FORMAT}, lambda t: isinstance(json.loads(t)["answer"], int), {"json_schema": SCHEMA}),
    ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t),
     {"regex": "[0-9]{3}-[a-z]{2}"}),
    ({"ebnf": 'root ::= "Answer: " [0-9]+'}, lambda t: re.fullmatch("Answer: [0-9]+", t),
     {"ebnf": 'root ::= "Answer: " [0-9]+'}),
])
def test_completions_constraints(client, served, body, check, constraint):
    r = client.completions.create(model=MODEL, prompt=EXAMPLE_QUESTION, temperature=0, max_tokens=48,
                                  extra_body=body)
    text = r.choices[0].text
    assert check(text), text
    assert text == _offline(served[1], constraint, chat=False)


@pytest.mark.parametrize("route, body, param, piece", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema", "json_schema: does not compile"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs json_schema.schema"),
    ("chat", {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "response_format.json_schema", "only for type json_schema"),
    ("completions", {"regex": "[0-9"}, "regex", "regex: does not compile"),
    ("completions", {"ebnf": "root ::= nothing"}, "ebnf", "ebnf: does not compile"),
    ("completions", {"regex": "a", "response_format": {"type": "json_object"}}, "regex",
     "not response_format and regex"),
])
def test_bad_grammar_is_a_400_naming_the_field(client, served, route, body, param, piece):
    url = served[0]
    if route == "chat":
        req = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    else:
        req = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **body}
    r = httpx.post(f"{url}/v1/{'chat/' if route == 'chat' else ''}completions", json=req, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and piece in err["message"], err
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")       # still serving


def test_named_tool_choice_under_dflash_is_the_schemas_output(client, served):
    """A named tool_choice is the same grammar as response_format: under DFlash the call's
    arguments equal the offline json_schema output without speculation."""
    msgs = [{"role": "user", "content": EXAMPLE_QUESTION}]
    tools = [{"type": "function", "function": {"name": "answer", "parameters": SCHEMA}}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48,
                                       tools=tools, tool_choice={"type": "function",
                                                                 "function": {"name": "answer"}})
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "answer"
    assert call.function.arguments == _offline(served[1], {"json_schema": SCHEMA})
