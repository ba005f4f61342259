"""Parsed request -> engine inputs (prompt token ids and SamplingParams), or an APIError that
names the field and says what was expected. Nothing is queued before every check has passed.

The value checks are the engine's own (``SamplingParams.validate``, ``check_token_ids``,
``check_context``, the same ones ``Engine.check_request`` runs for the offline API and the
CLI), called with the request's field names, so every way in refuses the same values with the
same words. What only the HTTP API has (n, model, stream_options, the OpenAI fields the engine
does not implement, the cap on prompts per request) is checked here."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from blockspec.engine.engine import GenerateError, check_context, check_token_ids
from blockspec.sampling import SEED_LIMIT, SamplingParams, SamplingParamsError
from blockspec.server import tools
from blockspec.server.chat_output import ChatSpec
from blockspec.server.errors import APIError
from blockspec.server.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    _Sampling,
)
from blockspec.server.reasoning import opens_reasoning
from blockspec.tokenizer import TokenizerError

DEFAULT_MAX_PROMPTS = 256
T = TypeVar("T")


@dataclass
class Item:
    """One engine request: a prompt and its sampling parameters."""

    prompt_ids: list[int]
    params: SamplingParams
    echo: str | None = None        # completions with echo: the prompt's text, put first


@dataclass
class Prepared:
    items: list[Item]          # prompt-major: prompt i, sample j is items[i * n + j]
    n: int
    return_logprob: bool
    chat: ChatSpec | None = None         # chat requests: how to shape the output
    top_logprobs: int = 0          # alternatives per token (engine's top_logprobs_num)
    prompt_logprobs: bool = False  # echo with logprobs: the prompt's too (logprob_start_len 0)


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_checked(check: Callable[[], T], rename: dict[str, str] | None = None,
                   code: str | None = None) -> T:
    """Run one of the engine's checks; its error becomes a 400 naming the request's field
    (``rename``: engine argument -> field, e.g. max_new_tokens -> max_tokens)."""
    try:
        return check()
    except (GenerateError, SamplingParamsError) as e:
        param = e.param
        if param is not None and rename:
            head, dot, rest = param.partition(".")
            param = rename.get(param) or (rename[head] + dot + rest if head in rename else param)
        message = str(e)
        for old, new in (rename or {}).items():
            message = message.replace(old, new)
        raise _bad(message, param, code) from None


def check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(404, f"model {name!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def _is_int(x: Any) -> bool:
    """An int, or a float JSON Schema counts as one (5.0)."""
    return (isinstance(x, int) and not isinstance(x, bool)) or (
        isinstance(x, float) and x.is_integer())


def _ints(xs: list) -> list[int]:
    return [int(x) for x in xs]


def _ids(ids: list[int], vocab: int, param: str) -> None:
    engine_checked(lambda: check_token_ids(ids, vocab, param))


def _max_tokens(value: int | None, prompt_len: int, context: int, prompt_param: str,
                default: int | None, least: int = 1) -> int:
    """max_tokens, or the default that fits; an error when prompt + max_tokens pass the
    context (both numbers named)."""
    wanted = value if value is not None else 1
    engine_checked(lambda: check_context(prompt_len, wanted, context, prompt_param=prompt_param,
                                         tokens_param="max_tokens"),
                   code="context_length_exceeded")
    if value is None:
        return min(default, context - prompt_len) if default is not None else context - prompt_len
    if value < least:
        raise _bad(f"max_tokens must be >= 1 (0 only with echo), got {value}", "max_tokens")
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


def _sampling(req: _Sampling, max_new_tokens: int, vocab: int,
              grammar: dict[str, Any] | None = None) -> SamplingParams:
    bias = None
    if req.logit_bias:
        bad = [k for k in req.logit_bias if not (k.isascii() and k.isdigit() and len(k) < 20)]
        if bad:
            raise _bad(f"logit_bias keys must be token ids (decimal strings), got {bad[0]!r}",
                       "logit_bias")
        bias = {int(k): v for k, v in req.logit_bias.items()}
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=req.temperature if req.temperature is not None else 1.0,
        top_p=req.top_p if req.top_p is not None else 1.0,
        top_k=req.top_k if req.top_k is not None else -1,
        min_p=req.min_p if req.min_p is not None else 0.0,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        seed=req.seed, presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        logit_bias=bias, min_new_tokens=req.min_tokens or 0, **(grammar or {}))
    return validated(params, vocab, {"max_new_tokens": "max_tokens"})


def validated(params: SamplingParams, vocab: int, rename: dict[str, str] | None = None
              ) -> SamplingParams:
    """The engine's sampling checks: ranges the step holds, stop_token_ids in the vocabulary."""
    engine_checked(params.validate, rename)
    if params.stop_token_ids:
        engine_checked(lambda: check_token_ids(list(params.stop_token_ids), vocab,
                                               "stop_token_ids"), rename)
    if params.logit_bias:
        engine_checked(lambda: check_token_ids([int(k) for k in params.logit_bias], vocab,
                                               "logit_bias"), rename)
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


def _cap(prompts: int, n: int, limit: int, param: str) -> None:
    """One request makes at most ``limit`` engine requests (prompts x n), so none can take
    the whole engine (admission also shares it out round-robin between requests)."""
    if prompts * n > limit:
        what = f"{prompts} prompts x n={n}" if n > 1 else f"{prompts} prompts"
        raise _bad(f"{param}: {what} = {prompts * n} sequences, more than the "
                   f"{limit} one request may ask for (--max-prompts-per-request); split it",
                   param if n == 1 else "n", "too_many_prompts")


def completion_inputs(req: CompletionRequest, engine: Any, served: str,
                      max_prompts: int = DEFAULT_MAX_PROMPTS) -> Prepared:
    _common(req, served)
    if req.suffix:
        raise _bad("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of is not supported (leave it unset or equal to n)", "best_of")
    prompts = _prompts(req.prompt, engine, req.n, max_prompts)
    grammar = _grammar(req, engine)
    texts = _echo_texts(req.prompt, prompts, engine) if req.echo else [None] * len(prompts)
    items = []
    for ids, text in zip(prompts, texts):
        mx = _max_tokens(req.max_tokens, len(ids), engine.context_length, "prompt", default=16,
                         least=0 if req.echo else 1)
        params = _sampling(req, mx, engine.config.vocab_size, grammar)
        items += [Item(ids, p, text) for p in _children(params, req.n)]
    return Prepared(items, req.n, return_logprob=req.logprobs is not None,
                    top_logprobs=req.logprobs or 0,
                    prompt_logprobs=req.echo and req.logprobs is not None)


def _echo_texts(prompt: Any, prompts: list[list[int]], engine: Any) -> list[str]:
    """The text each prompt is echoed as: its own string, or its token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    tok = engine.tokenizer
    return [tok.decode(ids) if tok is not None else "" for ids in prompts]


def _prompts(prompt: Any, engine: Any, n: int, max_prompts: int) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> token id lists."""
    vocab = engine.config.vocab_size
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        _cap(1, n, max_prompts, "prompt")
        _ids(_ints(prompt), vocab, "prompt")
        return [_ints(prompt)]
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)):
        _cap(len(prompt), n, max_prompts, "prompt")
        for i, p in enumerate(prompt):
            _ids(_ints(p), vocab, "prompt" if len(prompt) == 1 else f"prompt[{i}]")
        return [_ints(p) for p in prompt]
    elif isinstance(prompt, list) and not prompt:
        raise _bad("prompt is empty", "prompt")
    else:
        raise _bad("prompt must be a string, a list of strings, a list of token ids or a list "
                   "of lists of token ids", "prompt")
    _cap(len(texts), n, max_prompts, "prompt")
    tok = tokenizer_of(engine, "prompt")
    ids = [tok.encode(t) for t in texts]       # texts are UTF-8: protocol.py checked them
    if not all(ids):
        raise _bad("prompt is empty: give at least one token", "prompt")
    return ids


def tokenizer_of(engine: Any, param: str) -> Any:
    """The engine's tokenizer, or a 400 naming ``param`` when the model has none."""
    if engine.tokenizer is None:
        raise _bad("this model has no tokenizer (no tokenizer.json): send token ids to "
                   "/v1/completions or /generate", param)
    return engine.tokenizer


def chat_inputs(req: ChatCompletionRequest, engine: Any, served: str,
                max_prompts: int = DEFAULT_MAX_PROMPTS) -> Prepared:
    _common(req, served)
    _cap(1, req.n, max_prompts, "messages")
    if not req.messages:
        raise _bad("messages is empty: give at least one message", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs needs logprobs=true", "top_logprobs")
    if (req.max_tokens is not None and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens):
        raise _bad("max_tokens and max_completion_tokens disagree; give one", "max_tokens")
    tok = tokenizer_of(engine, "messages")
    if not tok.chat_template:
        raise _bad("this model's tokenizer has no chat template: use /v1/completions", "messages")
    plan = tools.plan(req)
    kwargs = req.chat_template_kwargs or {}
    try:
        prompt = tok.apply_chat_template(tools.template_messages(req), add_generation_prompt=True,
                                         tools=plan.template_tools, **kwargs)
    except TokenizerError as e:
        raise _bad(str(e), "messages") from None
    ids = tok.encode(prompt)
    wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    mx = _max_tokens(wanted, len(ids), engine.context_length, "messages", default=None)
    grammar = _grammar(req, engine) or tools.grammar(plan, req.parallel_tool_calls, engine)
    params = _sampling(req, mx, engine.config.vocab_size, grammar)
    spec = ChatSpec(plan, opens_reasoning(prompt), kwargs.get("enable_thinking") is not False,
                    req.separate_reasoning, req.include_reasoning)
    return Prepared([Item(ids, p) for p in _children(params, req.n)], req.n,
                    return_logprob=req.logprobs, chat=spec, top_logprobs=req.top_logprobs or 0)


def generate_inputs(req: GenerateRequest, engine: Any, max_prompts: int = DEFAULT_MAX_PROMPTS,
                    ) -> tuple[bool, list[Item], list[str] | None]:
    """(single, items, rids) for sglang's /generate."""
    if (req.text is None) == (req.input_ids is None):
        raise _bad("give exactly one of text or input_ids", "text")
    vocab = engine.config.vocab_size
    if req.text is not None:
        single = isinstance(req.text, str)
        texts = [req.text] if single else req.text
        if not texts:
            raise _bad("text is empty: give at least one prompt", "text")
        _cap(len(texts), 1, max_prompts, "text")
        tok = tokenizer_of(engine, "text")
        prompts = [tok.encode(t) for t in texts]
        params = ["text" if single else f"text[{i}]" for i in range(len(texts))]
    else:
        single = bool(req.input_ids) and all(_is_int(t) for t in req.input_ids)
        prompts = [req.input_ids] if single else list(req.input_ids)
        if not prompts:
            raise _bad("input_ids is empty: give at least one token", "input_ids")
        _cap(len(prompts), 1, max_prompts, "input_ids")
        params = ["input_ids" if single else f"input_ids[{i}]" for i in range(len(prompts))]
    for ids, param in zip(prompts, params):
        _ids(ids, vocab, param)
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
    for i, (ids, sp, param) in enumerate(zip(prompts, sps, params)):
        where = "sampling_params" if not isinstance(req.sampling_params, list) else \
            f"sampling_params[{i}]"
        try:
            sampling = SamplingParams.from_dict(sp)
        except SamplingParamsError as e:
            raise _bad(f"sampling_params: {e}",
                       f"{where}.{e.param}" if e.param else "sampling_params") from None
        except TypeError as e:
            raise _bad(f"sampling_params: {e}", "sampling_params") from None
        validated(sampling, vocab, {"stop_token_ids": f"{where}.stop_token_ids"})
        engine_checked(lambda: check_context(len(ids), sampling.max_new_tokens, context,
                                             prompt_param=param,
                                             tokens_param="max_new_tokens"),
                       {"max_new_tokens": f"{where}.max_new_tokens"}, "context_length_exceeded")
        items.append(Item(list(ids), sampling))
    return single, items, rids
