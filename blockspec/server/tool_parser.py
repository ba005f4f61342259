"""Tool calls in generated text (``tool_choice: auto``): incremental parsers of the formats
models are trained to emit, chosen with ``--tool-call-parser``.

* ``qwen3_coder`` (Nemotron 3, Qwen3-Coder): ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\n
  VALUE\\n</parameter>...</function>\\n</tool_call>``; each value is text, converted by the type
  the tool's schema gives the parameter (integer/number/boolean/null/object/array parsed as
  JSON where it parses, else kept as the string).
* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a call goes out
  as soon as its JSON object closes.

One parser per choice is fed the text as it arrives and returns events (content, the start of
a call, a fragment of its arguments); the non-streaming answer is the same parser fed the
whole text at once, so streaming and blocking always agree. Text that may be the start of
``<tool_call>`` is held back until it is known not to be. A call naming a function the request
did not offer (or one whose body does not parse) stays in the content as the model wrote it:
the server never invents a call the client cannot run. Whitespace just before a call is
dropped, and after the last one too; other text around calls is content."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["PARSERS", "Event", "ToolParser", "make_parser"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Event:
    """``kind``: "content" (``text``), "start" (call ``index`` named ``name``) or "args" (a
    fragment ``text`` of call ``index``'s arguments JSON)."""

    kind: str
    text: str = ""
    index: int = 0
    name: str = ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """The scan outside calls (content, held-back tag prefixes); subclasses parse a call body
    (``_body``) as it grows and at the end (``_end``)."""

    def __init__(self, tools: dict[str, dict]) -> None:
        self.tools = tools              # name -> parameters schema
        self.calls = 0                  # calls started so far
        self._buf = ""                  # text not yet handed out
        self._inside = False            # within <tool_call> ... </tool_call>
        self._passthrough = False       # inside a block that is kept as content
        self._gap = ""                  # whitespace before the open call

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        """The end of the output: held text is content, an unfinished call is closed."""
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self._inside:
            out += self._end()
        elif self._buf and not (self.calls and not self._buf.strip()):
            out.append(Event("content", self._buf))
        self._buf = ""
        return out

    def _step(self, out: list[Event], final: bool) -> bool:
        """Consume what can be decided now; True while progress is made."""
        if self._inside:
            return self._body(out, final)
        if self._passthrough:
            end = self._buf.find(CLOSE)
            if end < 0:
                keep = _partial_suffix(self._buf, CLOSE)
                self._emit(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._emit(out, self._buf[:end + len(CLOSE)])
            self._buf, self._passthrough = self._buf[end + len(CLOSE):], False
            return True
        at = self._buf.find(OPEN)
        if at < 0:          # hold a possible tag start and trailing whitespace: wait and see
            head = self._buf[:len(self._buf) - _partial_suffix(self._buf, OPEN)].rstrip()
            self._emit(out, head)
            self._buf = self._buf[len(head):]
            return False
        head = self._buf[:at].rstrip()
        self._emit(out, head)
        self._gap = self._buf[len(head):at]         # given back if the call is not one
        self._buf, self._inside = self._buf[at + len(OPEN):], True
        self._begin()
        return True

    @staticmethod
    def _emit(out: list[Event], text: str) -> None:
        if text:
            out.append(Event("content", text))

    def _reject(self, out: list[Event], raw: str) -> None:
        """Keep a call's text as content (unknown function, body that does not parse)."""
        self._inside = False
        self._emit(out, self._gap + OPEN + raw)

    def _start(self, out: list[Event], name: str) -> int:
        out.append(Event("start", index=self.calls, name=name))
        self.calls += 1
        return self.calls - 1

    # subclasses
    def _begin(self) -> None:
        pass

    def _body(self, out: list[Event], final: bool) -> bool:
        raise NotImplementedError

    def _end(self) -> list[Event]:
        raise NotImplementedError


class HermesParser(ToolParser):
    """JSON inside the tags; the call goes out whole as soon as its JSON object closes, and the
    ``</tool_call>`` after it is skipped. A body that is not a JSON object of a known function
    stays content, through its ``</tool_call>``."""

    _decoder = json.JSONDecoder()

    def _begin(self) -> None:
        self._closing = False           # the call went out; its </tool_call> may follow

    def _body(self, out: list[Event], final: bool) -> bool:
        lead = self._buf.lstrip()
        if self._closing:
            if lead.startswith(CLOSE):
                self._buf, self._inside = lead[len(CLOSE):], False
                return True
            if lead and not CLOSE.startswith(lead):
                self._inside = False            # no </tool_call>: the rest is outside the call
                return True
            return False
        if not lead:
            return False
        try:
            obj, used = self._decoder.raw_decode(lead) if lead.startswith("{") else (None, 0)
        except ValueError:                      # not closed yet, or not JSON
            at = self._buf.find(CLOSE)
            if at < 0:
                return False
            self._reject(out, self._buf[:at + len(CLOSE)])
            self._buf = self._buf[at + len(CLOSE):]
            return True
        if not isinstance(obj, dict):
            self._reject(out, "")
            self._passthrough = True            # the block, through </tool_call>, is content
            return True
        body_len = len(self._buf) - len(lead) + used
        raw, self._buf = self._buf[:body_len], self._buf[body_len:]
        args = obj.get("arguments", obj.get("parameters", {}))
        name = obj.get("name")
        if not isinstance(name, str) or name not in self.tools or not isinstance(args, (dict, str)):
            self._reject(out, raw)
            self._passthrough = True
            return True
        index = self._start(out, name)
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.append(Event("args", text, index=index))
        self._closing = True
        return True

    def _end(self) -> list[Event]:
        out: list[Event] = []
        if not self._closing:
            self._reject(out, self._buf)
        self._inside = False
        return out


_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]*)>")
_PARAM_END, _FUNCTION_END = "</parameter>", "</function>"


def _types(schema: Any) -> list[str]:
    """The JSON types a property schema allows, in its order ("type", or anyOf/oneOf arms)."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    found = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
    for arm in schema.get("anyOf", []) + schema.get("oneOf", []):
        found += [x for x in _types(arm) if x not in found]
    if not found and "enum" in schema:
        found = ["enum"]
    return found


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema asks for, trying its types in order (the
    string where none fits; null first for a nullable one)."""
    types = _types(schema)
    if "null" in types and value.strip().lower() in ("null", "none"):
        return None                     # a nullable parameter written as null
    for t in types:
        if t == "string":
            return value
        if t == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if t in ("integer", "number", "object", "array", "enum"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            ok = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                  "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
                  "enum": lambda v: v in schema["enum"]}[t]
            if ok(parsed):
                return parsed
    return value


class Qwen3CoderParser(ToolParser):
    """XML-ish parameters; the call starts once ``<function=NAME>`` is read, each parameter's
    arguments fragment goes out when its ``</parameter>`` closes, ``}`` with ``</function>``."""

    def _begin(self) -> None:
        self._raw = ""          # the call's text consumed so far (for a rejected call)
        self._index = -1        # the call's index once started
        self._params = 0
        self._done = False      # </function> seen, waiting for </tool_call>
        self._schema: Any = {}

    def _take(self, n: int) -> str:
        piece, self._buf = self._buf[:n], self._buf[n:]
        self._raw += piece
        return piece

    def _body(self, out: list[Event], final: bool) -> bool:
        if self._index < 0:
            m = _FUNCTION.match(self._buf)
            if m is None:
                lead = self._buf.lstrip()
                waiting = "<function=".startswith(lead) or (
                    lead.startswith("<function=") and len(lead) < 256 and "\n" not in lead)
                if final or waiting:
                    return False            # _end keeps an unnamed call as content
                self._reject(out, self._take(len(self._buf)))
                self._passthrough = True
                return True
            name = m.group(1).strip()
            self._take(m.end())
            if name not in self.tools:
                self._reject(out, self._raw)
                self._passthrough = True
                return True
            self._index = self._start(out, name)
            return True
        if self._done:
            stripped = self._buf.lstrip()
            if stripped.startswith(CLOSE):
                self._buf = stripped[len(CLOSE):]
                self._inside = False
                return True
            if stripped and not CLOSE.startswith(stripped):
                self._inside = False          # no </tool_call>: the rest is outside the call
                return True
            return False
        lead = self._buf.lstrip()
        if lead.startswith(_FUNCTION_END):
            self._take(len(self._buf) - len(lead) + len(_FUNCTION_END))
            out.append(Event("args", "}" if self._params else "{}", index=self._index))
            self._params, self._done = -1, True
            return True
        m = _PARAM.match(self._buf)
        if m is None:
            return False
        end = self._buf.find(_PARAM_END, m.end())
        if end < 0:
            return False
        name, value = m.group(1).strip(), self._buf[m.end():end]
        value = value.removeprefix("\n")
        value = value.removesuffix("\n")
        self._take(end + len(_PARAM_END))
        props = self._schema.get("properties") if isinstance(self._schema, dict) else None
        prop = props.get(name) if isinstance(props, dict) else None
        piece = json.dumps(name, ensure_ascii=False) + ": " + json.dumps(
            convert(value, prop), ensure_ascii=False)
        out.append(Event("args", ("{" if self._params == 0 else ", ") + piece, index=self._index))
        self._params += 1
        return True

    def _start(self, out: list[Event], name: str) -> int:
        self._schema = self.tools[name]
        return super()._start(out, name)

    def _end(self) -> list[Event]:
        out: list[Event] = []
        if self._index < 0:
            self._inside = False
            self._emit(out, self._gap + OPEN + self._raw + self._buf)
        elif not self._done:
            out.append(Event("args", "}" if self._params else "{}", index=self._index))
        self._inside = False
        return out


PARSERS: dict[str, type[ToolParser]] = {"qwen3_coder": Qwen3CoderParser, "hermes": HermesParser}


def make_parser(name: str, tools: dict[str, dict]) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; parsers: {', '.join(PARSERS)}")
    return PARSERS[name](tools)
