"""Parsed request -> engine inputs (prompt token ids and SamplingParams), or an APIError that
names the field and says what was expected. Every value check lives here, so a bad request is
refused before anything is queued."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from blockspec.sampling import SamplingParams, SamplingParamsError
from blockspec.server.errors import APIError
from blockspec.server.protocol import (ChatCompletionRequest, CompletionRequest, GenerateRequest,
                                       _Sampling)

MAX_N = 128
SEED_LIMIT = 2**64


@dataclass
class Item:
    """One engine request: a prompt and its sampling parameters."""

    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Prepared:
    items: list[Item]          # prompt-major: prompt i, sample j is items[i * n + j]
    n: int
    return_logprob: bool


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(404, f"model {name!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(name: str, value: float | None, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    if value is None:
        return default
    if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else f">= {lo:g}"
        raise _bad(f"{name} must be {'in ' if math.isfinite(hi) else ''}{interval}, got {value}", name)
    return float(value)


def _stops(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop must be a string or a list of strings", "stop")
    if any(not s for s in stops):
        raise _bad("stop strings must not be empty", "stop")
    return stops or None


def _check_ids(ids: list[int], vocab: int, param: str) -> None:
    if not ids:
        raise _bad(f"{param} is empty: give at least one token", param)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise _bad(f"{param}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab})", param)


def _max_tokens(value: int | None, prompt_len: int, context: int, prompt_param: str,
                default: int | None) -> int:
    if prompt_len >= context:
        raise _bad(f"the prompt has {prompt_len} tokens but the context holds {context} "
                   f"(prompt + output); shorten the prompt", prompt_param, "context_length_exceeded")
    if value is None:
        return min(default, context - prompt_len) if default is not None else context - prompt_len
    if value < 1:
        raise _bad(f"max_tokens must be >= 1, got {value}", "max_tokens")
    if prompt_len + value > context:
        raise _bad(f"the prompt has {prompt_len} tokens and max_tokens is {value}, together more "
                   f"than the context of {context} tokens; lower max_tokens to at most "
                   f"{context - prompt_len}", "max_tokens", "context_length_exceeded")
    return value


def _grammar(req: _Sampling, engine: Any) -> dict[str, Any]:
    """``response_format`` / ``regex`` / ``ebnf`` -> SamplingParams' constraint fields, compiled
    now (cached by the engine), so a bad schema is a 400 naming its field before anything is
    queued."""
    fields: dict[str, Any] = {}
    param = None
    fmt = req.response_format
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        raise _bad(f"response_format.json_schema is only for type json_schema, not {fmt.type}",
                   "response_format.json_schema")
    if fmt is not None and fmt.type == "json_object":
        fields, param = {"json_object": True}, "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise _bad("response_format of type json_schema needs json_schema.schema",
                       "response_format.json_schema.schema")
        fields, param = {"json_schema": fmt.json_schema.schema_}, "response_format.json_schema.schema"
    for name in ("regex", "ebnf"):
        if getattr(req, name) is not None:
            if param is not None:
                raise _bad(f"give one of response_format, regex and ebnf, not "
                           f"{param.split('.')[0]} and {name}", name)
            fields, param = {name: getattr(req, name)}, name
    if fields:
        try:
            engine.compile_grammar(SamplingParams(**fields))
        except ValueError as e:
            raise _bad(str(e), param) from None
    return fields


def _sampling(req: _Sampling, max_new_tokens: int, grammar: dict[str, Any] | None = None) -> SamplingParams:
    if req.presence_penalty or req.frequency_penalty:
        raise _bad("presence_penalty and frequency_penalty are not supported (only 0)",
                   "presence_penalty" if req.presence_penalty else "frequency_penalty")
    if req.logit_bias:
        raise _bad("logit_bias is not supported", "logit_bias")
    if req.top_k is not None and req.top_k != -1 and req.top_k < 1:
        raise _bad(f"top_k must be -1 (off) or >= 1, got {req.top_k}", "top_k")
    if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
        raise _bad(f"seed must be in [0, 2**64), got {req.seed}", "seed")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise _bad("stop_token_ids must be >= 0", "stop_token_ids")
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=_number("temperature", req.temperature, 1.0, 0.0, math.inf),
        top_p=_number("top_p", req.top_p, 1.0, 0.0, 1.0, lo_open=True),
        top_k=req.top_k if req.top_k is not None else -1,
        min_p=_number("min_p", req.min_p, 0.0, 0.0, 1.0),
        stop=_stops(req.stop), stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        seed=req.seed, **(grammar or {}))
    try:
        params.validate()
    except SamplingParamsError as e:       # a backstop: the checks above should catch it first
        raise _bad(str(e)) from None
    return params


def _children(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The ``n`` choices of one prompt: with a seed, child i samples with ``seed + i`` (as vLLM
    does), so the choices differ and each is reproducible on its own."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % SEED_LIMIT) for i in range(n)]


def _common(req: _Sampling, served: str) -> None:
    check_model(req.model, served)
    if not 1 <= req.n <= MAX_N:
        raise _bad(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed with stream=true", "stream_options")


def completion_inputs(req: CompletionRequest, engine: Any, served: str) -> Prepared:
    _common(req, served)
    if req.echo:
        raise _bad("echo is not supported", "echo")
    if req.suffix:
        raise _bad("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of is not supported (leave it unset or equal to n)", "best_of")
    if req.logprobs is not None and req.logprobs != 0:
        raise _bad("logprobs must be 0 (the chosen tokens' logprobs): top alternatives are "
                   f"not supported, got {req.logprobs}", "logprobs")
    prompts = _prompts(req.prompt, engine)
    grammar = _grammar(req, engine)
    items = []
    for ids in prompts:
        mx = _max_tokens(req.max_tokens, len(ids), engine.context_length, "prompt", default=16)
        params = _sampling(req, mx, grammar)
        items += [Item(ids, p) for p in _children(params, req.n)]
    return Prepared(items, req.n, return_logprob=req.logprobs is not None)


def _prompts(prompt: Any, engine: Any) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> token id lists."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        _check_ids(prompt, engine.config.vocab_size, "prompt")
        return [list(prompt)]
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)):
        for p in prompt:
            _check_ids(p, engine.config.vocab_size, "prompt")
        return [list(p) for p in prompt]
    elif isinstance(prompt, list) and not prompt:
        raise _bad("prompt is empty", "prompt")
    else:
        raise _bad("prompt must be a string, a list of strings, a list of token ids or a list "
                   "of lists of token ids", "prompt")
    tok = _tokenizer(engine, "prompt")
    ids = [tok.encode(t) for t in texts]
    for x in ids:
        if not x:
            raise _bad("prompt is empty: give at least one token", "prompt")
    return ids


def _tokenizer(engine: Any, param: str) -> Any:
    if engine.tokenizer is None:
        raise _bad("this model has no tokenizer (no tokenizer.json): send token ids to "
                   "/v1/completions or /generate", param)
    return engine.tokenizer


def chat_inputs(req: ChatCompletionRequest, engine: Any, served: str) -> Prepared:
    _common(req, served)
    if not req.messages:
        raise _bad("messages is empty: give at least one message", "messages")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise _bad("top_logprobs needs logprobs=true", "top_logprobs")
        if req.top_logprobs != 0:
            raise _bad("top_logprobs must be 0: top alternatives are not supported, got "
                       f"{req.top_logprobs}", "top_logprobs")
    if (req.max_tokens is not None and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens):
        raise _bad("max_tokens and max_completion_tokens disagree; give one", "max_tokens")
    tok = _tokenizer(engine, "messages")
    if not tok.chat_template:
        raise _bad("this model's tokenizer has no chat template: use /v1/completions", "messages")
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "".join(p.text for p in m.content)
        messages.append({"role": m.role, "content": content or ""})
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    mx = _max_tokens(wanted, len(ids), engine.context_length, "messages", default=None)
    params = _sampling(req, mx, _grammar(req, engine))
    return Prepared([Item(ids, p) for p in _children(params, req.n)], req.n,
                    return_logprob=req.logprobs)


def generate_inputs(req: GenerateRequest, engine: Any) -> tuple[bool, list[Item], list[str] | None]:
    """(single, items, rids) for sglang's /generate."""
    if (req.text is None) == (req.input_ids is None):
        raise _bad("give exactly one of text or input_ids", "text")
    if req.text is not None:
        single = isinstance(req.text, str)
        tok = _tokenizer(engine, "text")
        prompts = [tok.encode(t) for t in ([req.text] if single else req.text)]
        param = "text"
    else:
        single = bool(req.input_ids) and all(_is_int(t) for t in req.input_ids)
        prompts = [req.input_ids] if single else list(req.input_ids)
        param = "input_ids"
    for ids in prompts:
        _check_ids(ids, engine.config.vocab_size, param)
    sps = req.sampling_params
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    if len(sps) != len(prompts):
        raise _bad(f"sampling_params has {len(sps)} entries for {len(prompts)} prompts",
                   "sampling_params")
    rids = None if req.rid is None else ([req.rid] if isinstance(req.rid, str) else req.rid)
    if rids is not None and len(rids) != len(prompts):
        raise _bad(f"rid has {len(rids)} entries for {len(prompts)} prompts", "rid")
    items = []
    context = engine.context_length
    for ids, sp in zip(prompts, sps):
        try:
            params = SamplingParams.from_dict(sp)
        except (SamplingParamsError, TypeError) as e:
            raise _bad(f"sampling_params: {e}", "sampling_params") from None
        if len(ids) >= context or len(ids) + params.max_new_tokens > context:
            raise _bad(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                       f"exceeds the context of {context} tokens", "sampling_params",
                       "context_length_exceeded")
        items.append(Item(list(ids), params))
    return single, items, rids
