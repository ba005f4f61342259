"""Wire format: pydantic models of the request bodies (OpenAI's, plus sglang's native /generate)
and the dicts the responses are made of.

Models check shapes (strict types, no unknown fields: a typo such as ``temprature`` is an
error, not a silent default), the ranges a field can always be checked against (the bounds are
sampling.py's, the ones the engine itself enforces) and that every text encodes as UTF-8; the
OpenAPI schema is generated from them, so it says what the server accepts. Values that depend
on the model (context length, vocabulary) are checked in ``validate.py``."""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from blockspec.penalties import LOGIT_BIAS_MAX
from blockspec.runtime.logprobs import TOP_LOGPROBS_MAX
from blockspec.sampling import FLOAT32_MAX, SEED_LIMIT, TOP_K_MAX, not_utf8

MAX_N = 128
TEXT_ERROR = "text_not_utf8"          # the pydantic error type errors.py answers with 400


def _path(parts: list[str | int]) -> str:
    """['messages', 1, 'content'] -> 'messages[1].content'; a key that is not UTF-8 itself is
    written with backslash escapes (the path goes into an error message)."""
    out = ""
    for part in parts:
        if isinstance(part, str):
            part = part.encode("utf-8", "backslashreplace").decode("utf-8")
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def bad_text(value: Any, where: list[str | int] | None = None) -> tuple[str, str] | None:
    """(path, message) of the first string (or object key) in a parsed JSON value that UTF-8
    cannot encode (a lone surrogate such as "\\ud800"), else None."""
    where = where or []
    if isinstance(value, str):
        at = not_utf8(value)
        if at is not None:
            return _path(where), f"character {at} is {value[at]!r} (a lone surrogate)"
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and not_utf8(k) is not None:
                return _path(where + [k]), "the key is not UTF-8 (a lone surrogate)"
            found = bad_text(v, where + [k])
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = bad_text(v, where + [i])
            if found:
                return found
    return None


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data: Any) -> Any:
        """Text a tokenizer or a response encoder cannot take is refused here, by path."""
        found = bad_text(data)
        if found is not None:
            where, what = found
            raise PydanticCustomError(TEXT_ERROR, "{param} is not UTF-8 text: {what}",
                                      {"param": where, "what": what})
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False     # usage so far in every chunk (vLLM's option)


# The schema of fields typed Any (their shapes are checked in validate.py, with messages that
# name what was expected); JSON schema for what the server accepts.
_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
PROMPT_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT}, _IDS,
                           {"type": "array", "minItems": 1, "items": _IDS}]}
STOP_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT}, {"type": "null"}]}

def integral(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer, so the server takes it as 5 (any other float
    stays a type error)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(integral)]     # constraints go before the validator,
                                                    # else the schema shows "ge" for "minimum"
Token = Annotated[int, Field(ge=0), BeforeValidator(integral)]
AtLeastOne = Annotated[int, Field(ge=1), BeforeValidator(integral)]
AtLeastZero = Annotated[int, Field(ge=0), BeforeValidator(integral)]
TopN = Annotated[int, Field(ge=0, le=TOP_LOGPROBS_MAX), BeforeValidator(integral)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``; the schema is always enforced by the grammar
    (``strict`` or not), properties it does not name are generated only where it allows them."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """Fields both OpenAI endpoints share; ``top_k``, ``min_p``, ``ignore_eos`` and
    ``stop_token_ids`` are sglang's extensions (send them with the client's ``extra_body``)."""

    model: str | None = None
    max_tokens: AtLeastOne | None = None
    temperature: float | None = Field(None, ge=0, le=FLOAT32_MAX,
                                      description=">= 0 (0 = greedy) and at most 3.4e38")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Annotated[int, Field(ge=-1, le=TOP_K_MAX), BeforeValidator(integral)] | None = Field(
        None, description="-1 (off) or in [1, 2**31 - 1]", json_schema_extra={"not": {"const": 0}})
    min_p: float | None = Field(None, ge=0, le=1)
    stop: Any = Field(None, json_schema_extra=STOP_SCHEMA)       # str | list[str]
    stop_token_ids: list[Token] | None = None
    ignore_eos: bool = False
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT), BeforeValidator(integral)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(integral)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0, le=2)     # vLLM / sglang
    # token id (a decimal string below the vocabulary) -> bias added to its logit; the engine
    # checks both (a 400 naming logit_bias)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_MAX,
                                 "maximum": LOGIT_BIAS_MAX}})
    min_tokens: AtLeastZero | None = None       # vLLM: no EOS or stop token before this many
    # accepted and ignored: they change nothing in the output
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    rid: str | None = None                      # request id (sglang); abort it by this id
    response_format: ResponseFormat | None = None   # structured output (text: no constraint)
    regex: str | None = None                    # sglang's constraints, one at a time
    ebnf: str | None = None


class CompletionRequest(_Sampling):
    prompt: Any = Field(json_schema_extra=PROMPT_SCHEMA)
    max_tokens: AtLeastZero | None = Field(None, description=">= 1 (0 only with echo)")
    logprobs: TopN | None = None                # the chosen tokens' and this many alternatives
    echo: bool = False                          # the prompt (and its logprobs) come first
    suffix: str | None = Field(None, json_schema_extra={"anyOf": [{"const": ""}, {"type": "null"}]})
    best_of: Int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class CalledFunction(_Body):
    name: str
    arguments: str                  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None        # assistant messages that called tools
    tool_call_id: str | None = None                 # role tool: the call it answers
    reasoning_content: str | None = None            # an assistant turn's reasoning, for templates


class FunctionDef(_Body):
    """A tool's function; ``parameters`` is a JSON schema of an object (checked in
    validate.py, so a wrong one is a 400 naming it), always enforced when the tool is chosen."""

    name: str
    description: str | None = None
    parameters: Any = Field(None, json_schema_extra={"anyOf": [{"type": "object"},
                                                               {"type": "null"}]})
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: AtLeastOne | None = None
    logprobs: bool = False
    top_logprobs: TopN | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto with tools, none without")
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None      # e.g. {"enable_thinking": false}
    separate_reasoning: bool = Field(True, description="false: reasoning stays in content")
    include_reasoning: bool = Field(True, description="false: reasoning is dropped")


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a text, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None      # default: True for prompt, False for messages
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Token]


class GenerateRequest(_Body):
    """sglang's native /generate: text or input_ids (one or a batch) + sampling_params."""

    text: str | list[str] | None = None
    input_ids: list[Int] | list[list[Int]] | None = Field(None, json_schema_extra={
        "anyOf": [_IDS, {"type": "array", "minItems": 1, "items": _IDS}, {"type": "null"}]})
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    top_logprobs_num: TopN = 0                  # alternatives per output token
    logprob_start_len: Annotated[int, Field(ge=-1), BeforeValidator(integral)] = -1
    stream: bool = False
    rid: str | list[str] | None = None


class AbortRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["rid"], "properties": {"rid": {"type": "string"}}},
        {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}}]})

    rid: str | None = None
    abort_all: bool = False


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the server answers, OpenAI's shape."""

    error: ErrorDetail


# ---- responses -------------------------------------------------------------------------------
def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, spec: tuple[int, int] | None,
          cached_tokens: int | None = None) -> dict:
    """OpenAI usage (``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache
    held, when known); with speculation also the verify count and the mean tokens committed
    per verify (``spec`` = (verifies, committed tokens))."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if spec is not None:
        verifies, committed = spec
        out["spec_verify_ct"] = verifies
        out["spec_accept_length"] = committed / verifies if verifies else 0.0
    return out


def finish_reason(reason: dict | None) -> str | None:
    """Engine finish reason -> OpenAI's string (``abort`` as sglang sends it)."""
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason["type"], "abort")


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


DONE = sse("[DONE]")
