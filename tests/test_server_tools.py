"""Tool calling and reasoning over HTTP: the official ``openai`` client against one real server
on the tiny model, whose tokenizer gets a Qwen3-style chat template that renders tools, tool
calls and tool results (and opens ``<think>`` unless ``enable_thinking`` is false). The server
runs with ``--tool-call-parser qwen3_coder --reasoning-parser nemotron_3``. A named or
``required`` tool_choice is enforced by the grammar (so even random weights make a valid
call); ``auto`` is parsed, here from text a regex makes the model write."""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from blockspec import Engine  # noqa: E402
from blockspec.server.args import ServerArgs  # noqa: E402
from blockspec.server.chat_output import check_parsers  # noqa: E402
from blockspec.server.launch import ServerThread  # noqa: E402
from blockspec.server.protocol import ChatCompletionRequest  # noqa: E402
from blockspec.server.validate import chat_inputs  # noqa: E402
from blockspec.tiny_model import write_tiny_model  # noqa: E402

MODEL = "tiny"
TEMPLATE = (
    "{% if tools %}<s>system: tools:{% for t in tools %} {{ t.function | tojson }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<s>tool {{ m.tool_call_id }}: {{ m.content }}{{ '\\n' }}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<s>assistant: {{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>{% endfor %}{{ '\\n' }}"
    "{% else %}<s>{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% if enable_thinking is defined and "
    "not enable_thinking %}<think></think>{% else %}<think>\n{% endif %}{% endif %}")
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}}, "required": ["city", "days", "metric"],
    "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
QUIET = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tools") / "tiny")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    engine = Engine(model_path=str(folder), device="cpu")
    server = ServerThread(engine, served_model_name=MODEL, tool_call_parser="qwen3_coder",
                          reasoning_parser="nemotron_3")
    yield server.url, engine
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def _valid(name: str, args: dict) -> None:
    """Hand-checked against WEATHER / CLOCK (jsonschema is not a dependency)."""
    if name == "get_weather":
        assert set(args) == {"city", "days", "metric"}, args
        assert args["city"] in ("Paris", "Oslo", "Lima")
        assert type(args["days"]) is int and 1 <= args["days"] <= 7
        assert type(args["metric"]) is bool
    else:
        assert name == "get_time" and set(args) == {"zone"}
        assert isinstance(args["zone"], str) and len(args["zone"]) <= 6


def _streamed_calls(stream) -> tuple[list[list[str]], str | None, str]:
    calls, reason, content = [], None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index == len(calls) and tc.type == "function"
                calls.append([tc.function.name, ""])
            calls[tc.index][1] += tc.function.arguments or ""
        reason = c.finish_reason or reason
    return calls, reason, content


def test_named_tool_choice_forces_a_valid_call(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       temperature=0, max_tokens=64)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    _valid("get_weather", json.loads(call.function.arguments))
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True,
                                            tool_choice=choice, temperature=0, max_tokens=64)
    calls, reason, content = _streamed_calls(stream)
    assert calls == [["get_weather", call.function.arguments]] and reason == "tool_calls"
    assert content == ""


@pytest.mark.parametrize("parallel", [False, True])
def test_required_gives_calls(client, parallel):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                       tool_choice="required", parallel_tool_calls=parallel,
                                       max_tokens=160)
    c = r.choices[0]
    calls = c.message.tool_calls or []
    assert len(calls) == 1 if not parallel else len(calls) >= 1
    for call in calls:
        _valid(call.function.name, json.loads(call.function.arguments))
    assert c.finish_reason == ("tool_calls" if not parallel else c.finish_reason)
    assert c.finish_reason in ("tool_calls", "length")
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                            tool_choice="required", parallel_tool_calls=parallel,
                                            max_tokens=160, stream=True)
    got, reason, _ = _streamed_calls(stream)
    assert got == [[x.function.name, x.function.arguments] for x in calls]
    assert reason == c.finish_reason


CALL_TEXT = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
             "<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>")


def test_auto_parses_the_models_call_blocking_and_streaming(client):
    # the regex makes the model write a qwen3_coder call; the parser reads it out
    body = {**QUIET, "regex": "Let me check\\.\n" + CALL_TEXT.replace("\n", "\\n")}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                       max_tokens=200, extra_body=body)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    [call] = c.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] == "Oslo"
    assert type(args["days"]) is int                    # converted by the schema's type
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                            max_tokens=200, extra_body=body, stream=True)
    calls, reason, content = _streamed_calls(stream)
    assert calls == [["get_weather", call.function.arguments]]
    assert reason == "tool_calls" and content == "Let me check."
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                          tool_choice="none", max_tokens=200, extra_body=body)
    assert none.choices[0].message.tool_calls is None
    assert "<tool_call>" in none.choices[0].message.content


def _completion(client, prompt: str) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_reasoning_goes_to_reasoning_content(client, served):
    tok = served[1].tokenizer
    thinking = _completion(client, tok.apply_chat_template(ASK))
    assert "</think>" not in thinking
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12,
                                       extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    assert msg.reasoning_content == thinking and msg.content == ""
    stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                            max_tokens=12, extra_body={"ignore_eos": True},
                                            stream=True)
    parts = [getattr(c.choices[0].delta, "reasoning_content", None) or ""
             for c in stream if c.choices]
    assert "".join(parts) == thinking
    quiet = _completion(client, tok.apply_chat_template(ASK, enable_thinking=False))
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12,
                                       extra_body={"ignore_eos": True, **QUIET})
    assert r.choices[0].message.content == quiet and r.choices[0].message.reasoning_content is None
    r = httpx.post(served[0] + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
        "include_reasoning": False}).json()
    assert "reasoning_content" not in r["choices"][0]["message"]
    r = httpx.post(served[0] + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
        "separate_reasoning": False}).json()
    assert r["choices"][0]["message"]["content"] == thinking


HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function",
               "function": {"name": "get_weather",
                            "arguments": '{"city": "Paris", "days": 2, "metric": true}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]


def test_tool_messages_render_through_the_template(client, served):
    engine = served[1]
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS,
                                                "max_tokens": 8})
    prompt = engine.tokenizer.decode(chat_inputs(req, engine, MODEL).items[0].prompt_ids)
    assert '"name": "get_weather"' in prompt and '"maxLength": 6' in prompt     # tools rendered
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n<parameter=metric>\nTrue\n</parameter>") in prompt
    assert "tool call_1: 18C and sunny\n" in prompt
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, temperature=0,
                                       max_tokens=4, extra_body=QUIET)
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS,
                                                "max_tokens": 4, **QUIET})
    assert r.usage.prompt_tokens == len(chat_inputs(req, engine, MODEL).items[0].prompt_ids)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("body, param, piece", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "JSON schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "abc"}}]},
     "tools[0].function.parameters", "JSON schema of an object"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "two tools are named"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": NAMED}, "tool_choice", "no tools are given"),
    ({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"a": {"type": 3}}}}}], "tool_choice": NAMED},
     "tools[0].function.parameters", "does not compile"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "tool_choice", "cannot go with response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "must be a JSON object"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "only assistant messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "required"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "tool_choice", "cannot go with regex"),
])
def test_bad_tool_input_is_a_400_naming_the_field(client, served, body, param, piece):
    req = {"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
    r = httpx.post(served[0] + "/v1/chat/completions", json=req, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and piece in err["message"], err
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                        tool_choice="none", parallel_tool_calls=False)
    assert ok.choices[0].finish_reason in ("stop", "length")       # still serving


def test_unknown_parser_flag_is_refused():
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        ServerArgs(tool_call_parser="nope").validate()
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        ServerArgs(reasoning_parser="deepseek").validate()
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        check_parsers("nope", None)
    with pytest.raises(ValueError, match="unknown reasoning parser 'deepseek'"):
        check_parsers(None, "deepseek")
