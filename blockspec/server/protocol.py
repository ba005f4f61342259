"""Wire format: pydantic models of the request bodies (OpenAI's, plus sglang's native /generate)
and the dicts the responses are made of.

Models check shapes only (strict types, no unknown fields: a typo such as ``temprature`` is an
error, not a silent default). Values (ranges, context length, vocabulary) are checked in
``validate.py`` so each error can name its field and say what was expected."""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


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
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: Any = None                      # str | list[str]; checked in validate.py
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None       # accepted when 0 (not implemented otherwise)
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    rid: str | None = None                      # request id (sglang); abort it by this id
    response_format: ResponseFormat | None = None   # structured output (text: no constraint)
    regex: str | None = None                    # sglang's constraints, one at a time
    ebnf: str | None = None


class CompletionRequest(_Sampling):
    prompt: Any                           # str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class GenerateRequest(_Body):
    """sglang's native /generate: text or input_ids (one or a batch) + sampling_params."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class AbortRequest(_Body):
    rid: str | None = None
    abort_all: bool = False


# ---- responses -------------------------------------------------------------------------------
def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, spec: tuple[int, int] | None) -> dict:
    """OpenAI usage; with speculation also the verify count and the mean tokens committed per
    verify (``spec`` = (verifies, committed tokens))."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
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
