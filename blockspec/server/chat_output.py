"""A chat choice's generated text -> OpenAI's message (blocking) or deltas (streaming): the
reasoning split off (reasoning.py), tool calls parsed (tool_parser.py) or read off the JSON an
enforced ``tool_choice`` produced, the finish reason ``tool_calls`` when a call was made and
the model stopped by itself (``length`` stays ``length``).

The blocking message is the streaming path fed the whole text at once, so both always agree.
An enforced choice is JSON from the first token (the grammar starts there), so its output is
not split for reasoning; with ``separate_reasoning`` false the reasoning parser is off and
the tool parser reads the whole text."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from blockspec.server.protocol import finish_reason
from blockspec.server.reasoning import REASONING_PARSERS, ReasoningParser
from blockspec.server.tool_parser import Event, make_parser
from blockspec.server.tools import ToolPlan


@dataclass
class ChatSpec:
    """What a chat request's output shaping needs (made in validate.py)."""

    tools: ToolPlan = field(default_factory=ToolPlan)
    prompt_opens_reasoning: bool = False     # the rendered prompt ends inside <think>
    thinking: bool = True                    # chat_template_kwargs.enable_thinking is not false
    separate_reasoning: bool = True
    include_reasoning: bool = True


def check_parsers(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """Refuse unknown parser names when the app is made, not at the first request."""
    if tool_parser is not None:
        make_parser(tool_parser, {})
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; parsers: "
                         f"{', '.join(REASONING_PARSERS)}")


class _Named:
    """``tool_choice`` naming a function: the whole output is the call's arguments."""

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def feed(self, text: str) -> list[Event]:
        out = [] if self.started else [Event("start", name=self.name)]
        self.started = True
        return out + ([Event("args", text)] if text else [])

    def finish(self) -> list[Event]:
        return self.feed("")


class _Required:
    """``tool_choice: required``: a JSON array of {"name", "parameters"}; each element becomes
    a call as soon as its object closes (an element cut off by the length limit is dropped)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape = 0, False, False
        self.item, self.calls = "", 0

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for ch in text:
            if self.depth >= 2:
                self.item += ch
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.item = ch
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1:
                    obj = json.loads(self.item)
                    out += [Event("start", index=self.calls, name=obj["name"]),
                            Event("args", json.dumps(obj["parameters"], ensure_ascii=False),
                                  index=self.calls)]
                    self.calls += 1
        return out

    def finish(self) -> list[Event]:
        return []


class _Text:
    """No tool parsing: everything is content."""

    def feed(self, text: str) -> list[Event]:
        return [Event("content", text)] if text else []

    def finish(self) -> list[Event]:
        return []


class ChoiceOutput:
    """One choice's shaping state: ``delta(text)`` per streamed piece, ``end()`` at the end,
    or ``message(text)`` for a blocking answer."""

    def __init__(self, spec: ChatSpec, tool_parser: str | None, reasoning_parser: str | None
                 ) -> None:
        plan = spec.tools
        self.spec = spec
        self.reasoning = None
        if reasoning_parser is not None and spec.separate_reasoning and plan.forced is None:
            self.reasoning = ReasoningParser(spec.prompt_opens_reasoning and spec.thinking,
                                             may_open=spec.thinking)
        if plan.forced == "named":
            self.tools: Any = _Named(plan.name or "")
        elif plan.forced == "required":
            self.tools = _Required()
        elif plan.choice == "auto" and tool_parser is not None:
            self.tools = make_parser(tool_parser, plan.schemas)
        else:
            self.tools = _Text()
        self.ids: list[str] = []

    def _shape(self, reasoning: str, events: list[Event]) -> dict:
        delta: dict[str, Any] = {}
        if reasoning and self.spec.include_reasoning:
            delta["reasoning_content"] = reasoning
        content = "".join(e.text for e in events if e.kind == "content")
        if content:
            delta["content"] = content
        calls: list[dict] = []
        for e in events:
            if e.kind == "start":
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                calls.append({"index": e.index, "id": self.ids[e.index], "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif e.kind == "args":
                if calls and calls[-1]["index"] == e.index:
                    calls[-1]["function"]["arguments"] += e.text
                else:
                    calls.append({"index": e.index, "function": {"arguments": e.text}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    def delta(self, text: str) -> dict:
        if self.reasoning is None:
            return self._shape("", self.tools.feed(text))
        reasoning, content = self.reasoning.feed(text)
        return self._shape(reasoning, self.tools.feed(content) if content else [])

    def end(self) -> dict:
        """What was held back, at the end of the output."""
        reasoning = content = ""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
        events = self.tools.feed(content) if content else []
        return self._shape(reasoning, events + self.tools.finish())

    def finish_reason(self, reason: dict | None) -> str | None:
        why = finish_reason(reason)
        return "tool_calls" if why == "stop" and self.ids else why

    def message(self, text: str) -> dict:
        """The blocking answer: the deltas of the whole text, merged."""
        reasoning, content, calls = "", "", []
        for d in (self.delta(text), self.end()):
            reasoning += d.get("reasoning_content", "")
            content += d.get("content", "")
            for c in d.get("tool_calls", []):
                if "id" in c:
                    calls.append({"id": c["id"], "type": "function",
                                  "function": {"name": c["function"]["name"], "arguments": ""}})
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        msg: dict[str, Any] = {"role": "assistant",
                               "content": content if content or not calls else None}
        if self.reasoning is not None and self.spec.include_reasoning:
            msg["reasoning_content"] = reasoning or None
        if calls:
            msg["tool_calls"] = calls
        return msg


def stream_delta(shaper: ChoiceOutput, text: str, finished: bool) -> dict:
    """The delta of one streamed output (its held-back rest with the last one)."""
    delta = shaper.delta(text)
    if not finished:
        return delta
    rest = shaper.end()
    for key in ("reasoning_content", "content"):
        if key in rest:
            delta[key] = delta.get(key, "") + rest[key]
    if "tool_calls" in rest:
        delta["tool_calls"] = delta.get("tool_calls", []) + rest["tool_calls"]
    return delta
