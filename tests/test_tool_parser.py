"""Tool-call and reasoning parsers on text in the formats models emit (Nemotron 3 / Qwen3-Coder
XML-ish calls, Hermes JSON calls, ``<think>`` reasoning): what they extract, and that feeding
the text in pieces split at every character boundary gives what feeding it whole gives."""
from __future__ import annotations

import json

import pytest

from blockspec.server import args as server_args
from blockspec.server.chat_output import ChatSpec, ChoiceOutput, stream_delta
from blockspec.server.reasoning import REASONING_PARSERS, ReasoningParser, opens_reasoning
from blockspec.server.tool_parser import PARSERS, convert, make_parser
from blockspec.server.tools import ToolPlan
from blockspec.tiny_model import byte_level_tokenizer_json
from blockspec.tokenizer import Tokenizer, TokenizerError

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
    "where": {"type": "object"}, "note": {"type": ["string", "null"]}}, "required": ["city"]}
TOOLS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}

QWEN = ("I'll look that up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco"
        "\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        "<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n[\"rain\", \"wind\"]\n</parameter>\n"
        "<parameter=where>\n{\"lat\": 37.7}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n")
QWEN_ARGS = {"city": "San Francisco", "days": 3, "metric": True, "ratio": 0.5,
             "tags": ["rain", "wind"], "where": {"lat": 37.7}, "note": None}
HERMES = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
          '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
THINK = ("The user wants the weather. I should call get_weather with city Paris.\n</think>\n\n"
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
         "</tool_call>")


def collapse(events) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", []
    for e in events:
        if e.kind == "content":
            content += e.text
        elif e.kind == "start":
            assert e.index == len(calls)
            calls.append([e.name, ""])
        else:
            calls[e.index][1] += e.text
    return content, [tuple(c) for c in calls]


def whole(name: str, text: str, tools=TOOLS):
    p = make_parser(name, tools)
    return collapse(p.feed(text) + p.finish())


def split_at(name: str, text: str, cuts: list[int], tools=TOOLS):
    p = make_parser(name, tools)
    events, last = [], 0
    for c in cuts + [len(text)]:
        events += p.feed(text[last:c])
        last = c
    return collapse(events + p.finish())


def test_qwen3_coder_calls_and_types():
    content, calls = whole("qwen3_coder", QWEN)
    assert content == "I'll look that up."
    assert [c[0] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == QWEN_ARGS
    assert json.loads(calls[1][1]) == {}


def test_hermes_calls():
    content, calls = whole("hermes", HERMES)
    assert content == "Checking."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo", "days": 2}),
                                                      ("get_time", {})]


@pytest.mark.parametrize("name, text", [("qwen3_coder", QWEN), ("hermes", HERMES),
                                        ("qwen3_coder", "no calls at all < here <tool"),
                                        ("hermes", "a <tool_call> cut off {\"name\": "),
                                        ("hermes", ('<tool_call>{"name": "get_time", "arguments": '
                                                    '{}} oops</tool_call> end'))])
def test_every_split_point_gives_the_whole_result(name, text):
    want = whole(name, text)
    for cut in range(len(text) + 1):
        assert split_at(name, text, [cut]) == want, cut
    assert split_at(name, text, list(range(1, len(text)))) == want       # char by char


@pytest.mark.parametrize("name, text", [
    ("qwen3_coder", ("<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n"
                     "</function>\n</tool_call> done")),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call> done'),
    ("hermes", "<tool_call>{not json}</tool_call> done"),
])
def test_unknown_function_or_bad_body_stays_content(name, text):
    assert whole(name, text) == (text, [])
    assert split_at(name, text, list(range(1, len(text)))) == (text, [])


def test_cut_off_call_is_closed_with_its_complete_parameters():
    text = QWEN[:QWEN.index("<parameter=days>") + 20]
    _, calls = whole("qwen3_coder", text)
    assert calls == [("get_weather", '{"city": "San Francisco"}')]
    assert whole("qwen3_coder", "hi <tool_call>\n<func") == ("hi <tool_call>\n<func", [])


def test_convert_follows_the_schema():
    assert convert("42", {"type": "integer"}) == 42
    assert convert("42", {"type": "string"}) == "42"
    assert convert("4.5", {"type": "integer"}) == "4.5"        # not an integer: kept as text
    assert convert("false", {"type": "boolean"}) is False
    assert convert("[1]", {"anyOf": [{"type": "array"}, {"type": "null"}]}) == [1]
    assert convert("x", None) == "x"


def test_registries_match_the_flags():
    assert tuple(PARSERS) == server_args.TOOL_CALL_PARSERS
    assert REASONING_PARSERS == server_args.REASONING_PARSERS


def _reason(text: str, cuts: list[int], **kw) -> tuple[str, str]:
    p, r, c, last = ReasoningParser(**kw), "", "", 0
    for cut in cuts + [len(text)]:
        a, b = p.feed(text[last:cut])
        r, c, last = r + a, c + b, cut
    a, b = p.finish()
    return r + a, c + b


def test_reasoning_split_at_every_boundary():
    body = "Let me think </th about it.\n"
    text = body + "</think>\n\nThe answer is 4."
    for cut in range(len(text) + 1):
        assert _reason(text, [cut], in_reasoning=True) == (body, "\n\nThe answer is 4."), cut
    opened = "<think>" + text
    for cut in range(len(opened) + 1):
        assert _reason(opened, [cut], in_reasoning=False) == (body, "\n\nThe answer is 4."), cut
    assert _reason(opened, [3], in_reasoning=False, may_open=False) == ("", opened)
    assert _reason("cut off while thinking </thi", [5], in_reasoning=True) == (
        "cut off while thinking </thi", "")
    assert _reason("plain <think> later", [2], in_reasoning=False) == ("", "plain <think> later")
    assert opens_reasoning("<s>assistant: <think>\n") and not opens_reasoning("<think></think>")


def _choice(text: str, cuts: list[int], spec: ChatSpec, tool_parser="qwen3_coder"):
    """(streamed message rebuilt from deltas, blocking message)."""
    stream = ChoiceOutput(spec, tool_parser, "nemotron_3")
    deltas, last = [], 0
    for cut in cuts + [len(text)]:
        deltas.append(stream_delta(stream, text[last:cut], cut == len(text)))
        last = cut
    r, c, calls = "", "", []
    for d in deltas:
        r, c = r + d.get("reasoning_content", ""), c + d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["id"].startswith("call_")
                calls.append([tc["function"]["name"], ""])
            calls[tc["index"]][1] += tc["function"]["arguments"]
    blocking = ChoiceOutput(spec, tool_parser, "nemotron_3").message(text)
    return (r, c, calls), blocking


def test_reasoning_then_tool_call_streams_as_it_blocks():
    spec = ChatSpec(ToolPlan(TOOLS, choice="auto"), prompt_opens_reasoning=True)
    for cut in range(0, len(THINK) + 1, 3):
        (r, c, calls), msg = _choice(THINK, [cut], spec)
        assert r == msg["reasoning_content"] == THINK[:THINK.index("</think>")]
        assert c == "" and msg["content"] is None           # only whitespace besides the call
        assert calls == [["get_weather", '{"city": "Paris"}']]
        assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Paris"}'}
    dropped = ChoiceOutput(ChatSpec(ToolPlan(TOOLS, choice="auto"), True, include_reasoning=False),
                           "qwen3_coder", "nemotron_3").message(THINK)
    assert "reasoning_content" not in dropped and dropped["tool_calls"]
    raw = ChoiceOutput(ChatSpec(ToolPlan(), True, separate_reasoning=False), None,
                       "nemotron_3").message(THINK)
    assert raw == {"role": "assistant", "content": THINK}
    off = ChoiceOutput(ChatSpec(ToolPlan(), True, thinking=False), None, "nemotron_3").message("Hi")
    assert off["content"] == "Hi" and off["reasoning_content"] is None


def test_finish_reason_and_forced_required():
    out = ChoiceOutput(ChatSpec(ToolPlan(TOOLS, forced="required", choice="required")), None, None)
    text = '[{"name":"get_weather","parameters":{"city":"a\\"]}"}},{"name":"get_time","parameters":{}}]'
    msg = out.message(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("get_weather", {"city": 'a"]}'}), ("get_time", {})]
    assert out.finish_reason({"type": "stop"}) == "tool_calls"
    assert out.finish_reason({"type": "length"}) == "length"
    plain = ChoiceOutput(ChatSpec(ToolPlan(TOOLS, choice="auto")), None, None)
    assert plain.message(QWEN) == {"role": "assistant", "content": QWEN}       # no parser
    assert plain.finish_reason({"type": "stop"}) == "stop"


def test_hermes_call_without_its_closing_tag_at_the_end():
    text = 'ok <tool_call>{"name": "get_time", "arguments": {}}'
    assert whole("hermes", text) == ("ok", [("get_time", "{}")])
    assert split_at("hermes", text, list(range(1, len(text)))) == ("ok", [("get_time", "{}")])


def test_chat_template_gets_tools_kwargs_and_hf_helpers(tmp_path):
    (tmp_path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    template = ("{% for t in tools %}{{ t | tojson }}{% endfor %}{% for m in messages %}"
                "{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                "{% for c in m.tool_calls %}{{ c.function.arguments.city }}{% break %}"
                "{% endfor %}{% endfor %}{{ 'T' if enable_thinking else 'F' }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer(tmp_path)
    call = {"function": {"name": "f", "arguments": {"city": "Zürich"}}}
    out = tok.apply_chat_template([{"role": "assistant", "tool_calls": [call, call]}],
                                  tools=[{"a": "<é>"}], enable_thinking=True)
    assert out == '{"a": "<é>"}ZürichT'                   # HF's tojson: no HTML escapes
    with pytest.raises(TokenizerError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad"}], tools=[])
    with pytest.raises(TokenizerError, match="the chat template failed: TypeError"):
        tok.apply_chat_template([{"role": "user"}])             # tools=None is not iterable
    tok.chat_template = "{% for %}"
    with pytest.raises(TokenizerError, match="the chat template failed"):
        tok.apply_chat_template([])


def test_hermes_call_goes_out_when_its_json_closes():
    p = make_parser("hermes", TOOLS)
    assert collapse(p.feed('<tool_call>\n{"name": "get_time", "arguments": {"a": "}"}')) == ("", [])
    assert collapse(p.feed("}")) == ("", [("get_time", '{"a": "}"}')])      # before </tool_call>
    assert collapse(p.feed("\n</tool_call>\nbye") + p.finish()) == ("\nbye", [])
