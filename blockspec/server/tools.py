"""The request side of tool calling: ``tools`` and ``tool_choice`` checked (400s naming the
field), the grammar that enforces a named or ``required`` choice, and chat messages turned
into the dicts a chat template reads.

Enforced choices follow vLLM: a named function constrains the output to a JSON object valid
against its ``parameters`` (the text is the call's ``arguments``); ``required`` constrains it
to a JSON array (at least one item, at most one without ``parallel_tool_calls``) of
``{"name": <a tool's name>, "parameters": <that tool's schema>}`` objects. A function with no
``parameters`` takes none (``{}``), as OpenAI defines it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from blockspec.sampling import SamplingParams
from blockspec.server.errors import APIError
from blockspec.server.protocol import ChatCompletionRequest

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    """What the output side needs: the offered tools (name -> parameters schema), the
    enforced mode ("named", "required" or None) and the tools given to the template."""

    schemas: dict[str, dict] = field(default_factory=dict)
    forced: str | None = None
    name: str | None = None              # the named function
    choice: str = "none"                 # "none", "auto", "required" or "named"
    template_tools: list[dict] | None = None


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _is_object_schema(schema: Any) -> bool:
    t = schema.get("type", "object") if isinstance(schema, dict) else None
    return t == "object" or (isinstance(t, list) and "object" in t)


def plan(req: ChatCompletionRequest) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` against each other."""
    tools = req.tools or []
    choice = req.tool_choice
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        if not fn.name or len(fn.name) > 64 or not all(c.isalnum() or c in "_-." for c in fn.name):
            raise _bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.', "
                       f"got {fn.name!r}", f"tools[{i}].function.name")
        if fn.name in schemas:
            raise _bad(f"two tools are named {fn.name!r}; names must be unique",
                       f"tools[{i}].function.name")
        if fn.parameters is not None and not _is_object_schema(fn.parameters):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema of an object "
                       f"(type object), got {json.dumps(fn.parameters)[:80]}",
                       f"tools[{i}].function.parameters")
        schemas[fn.name] = fn.parameters if fn.parameters is not None else NO_PARAMETERS
    if isinstance(choice, str) or choice is None:
        mode = choice or ("auto" if tools else "none")
        if mode != "none" and not tools:
            raise _bad(f"tool_choice {mode!r} needs tools", "tool_choice")
        forced, name = ("required" if mode == "required" else None), None
    else:
        if not tools:
            raise _bad("tool_choice names a function but no tools are given", "tool_choice")
        if choice.function.name not in schemas:
            raise _bad(f"tool_choice names {choice.function.name!r}, which is not in tools "
                       f"({', '.join(schemas)})", "tool_choice")
        mode, forced, name = "named", "named", choice.function.name
    if forced is not None and (req.response_format is not None or req.regex or req.ebnf):
        what = "response_format" if req.response_format is not None else (
            "regex" if req.regex else "ebnf")
        raise _bad(f"tool_choice {mode if mode != 'named' else 'naming a function'} enforces "
                   f"the output; it cannot go with {what}", "tool_choice")
    template = [t.model_dump(exclude_none=True) for t in tools] or None
    return ToolPlan(schemas, forced, name, mode, template)


def grammar(p: ToolPlan, parallel: bool, engine: Any) -> dict[str, Any]:
    """SamplingParams' constraint for an enforced choice, compiled now: a schema xgrammar
    refuses is a 400 naming that tool's parameters."""
    if p.forced is None:
        return {}
    names = [p.name] if p.forced == "named" else list(p.schemas)
    index = {n: i for i, n in enumerate(p.schemas)}
    for n in names:
        try:
            engine.compile_grammar(SamplingParams(json_schema=p.schemas[n]))
        except ValueError as e:
            raise _bad(f"tools[{index[n]}].function.parameters: {e}",
                       f"tools[{index[n]}].function.parameters") from None
    if p.forced == "named":
        return {"json_schema": p.schemas[p.name]}
    items = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                         "parameters": p.schemas[n]},
                        "required": ["name", "parameters"], "additionalProperties": False}
                       for n in names]}
    schema = {"type": "array", "minItems": 1, "items": items, **({} if parallel else {"maxItems": 1})}
    try:
        engine.compile_grammar(SamplingParams(json_schema=schema))
    except ValueError as e:
        raise _bad(f"tools: the schema of tool_choice 'required' does not compile: {e}",
                   "tools") from None
    return {"json_schema": schema}


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as HF chat templates read them: content a string (null beside tool calls),
    ``tool_calls[].function.arguments`` parsed to dicts, ``tool_call_id`` on tool results."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "".join(p.text for p in m.content)
        # null stays null beside tool calls (as the client sent it); elsewhere it is ""
        msg: dict[str, Any] = {"role": m.role,
                               "content": "" if content is None and not m.tool_calls else content}
        if m.name is not None:
            msg["name"] = m.name
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            if m.role != "assistant":
                raise _bad(f"messages[{i}].tool_calls: only assistant messages make tool calls",
                           f"messages[{i}].tool_calls")
            calls = []
            for j, c in enumerate(m.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    args = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
                except ValueError as e:
                    raise _bad(f"{where} is not JSON: {e}", where) from None
                if not isinstance(args, dict):
                    raise _bad(f"{where} must be a JSON object", where)
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_call_id is None:
                raise _bad(f"messages[{i}].tool_call_id is required on a tool message",
                           f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id is not None:
            raise _bad(f"messages[{i}].tool_call_id is only for role tool",
                       f"messages[{i}].tool_call_id")
        out.append(msg)
    return out
