"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, sglang's
/generate and /abort_request, /health and /metrics. Routes validate (validate.py), submit to the
engine through EngineClient (client.py) and shape its outputs into responses (protocol.py);
they never touch tensors."""
from __future__ import annotations

import contextlib
import copy
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from blockspec import __version__
from blockspec.engine.loop import StreamOutput
from blockspec.server import errors
from blockspec.server.chat_output import ChatSpec, ChoiceOutput, check_parsers, stream_delta
from blockspec.server.client import ClientGone, EngineClient, Group, ServerShuttingDown
from blockspec.server.errors import APIError, error_body, error_response
from blockspec.server.logprobs import chat_logprobs, completion_logprobs
from blockspec.server.metrics import CONTENT_TYPE, Metrics
from blockspec.server.middleware import Guard
from blockspec.server.protocol import (
    DONE,
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    GenerateRequest,
    TokenizeRequest,
    finish_reason,
    now,
    sse,
    usage,
)
from blockspec.server.tokenize import ROUTES as TOKENIZE_ROUTES
from blockspec.server.tokenize import add_tokenize_routes
from blockspec.server.validate import (
    DEFAULT_MAX_PROMPTS,
    Prepared,
    chat_inputs,
    check_model,
    completion_inputs,
    generate_inputs,
)

log = logging.getLogger("blockspec")
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/generate",
                    "/abort_request", "/health", "/metrics"}) | TOKENIZE_ROUTES
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
MODELS = (CompletionRequest, ChatCompletionRequest, GenerateRequest, AbortRequest,
          TokenizeRequest, DetokenizeRequest)

# The responses each route can give, for the OpenAPI schema (every error is ErrorResponse).
_WHY = {400: "malformed JSON, text that is not UTF-8, or a value out of range (param names it)",
        401: "missing or wrong API key", 404: "unknown model or request id",
        413: "request body too large", 422: "wrong shape: a type, an unknown or missing field",
        429: "too many queued requests", 500: "engine or server failure",
        503: "shutting down, or the engine is not running"}


def _errors(*codes: int) -> dict[int | str, dict]:
    return {c: {"model": ErrorResponse, "description": _WHY[c]} for c in codes}


ANY_ROUTE = _errors(401, 413, 500)
POSTED = {**ANY_ROUTE, **_errors(400, 404, 422, 429, 503)}
STREAMED = {**POSTED, 200: {"description": "JSON, or with stream=true server-sent events "
                                           "ending in 'data: [DONE]'",
                            "content": {"text/event-stream": {"schema": {
                                "type": "object", "required": ["data"],
                                "properties": {"data": {"type": "string"}}}}}}}


@dataclass
class Choice:
    """What one engine request has produced so far."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int]] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    reason: dict | None = None
    tops: list[list[tuple[float, int]]] = field(default_factory=list)
    prompt: tuple[list, list] | None = None      # prompt (logprob, id) pairs and alternatives

    def add(self, out: StreamOutput) -> None:
        self.text += out.text
        self.ids += out.token_ids
        self.logprobs += out.logprobs
        self.tops += out.top_logprobs
        if out.prompt_logprobs is not None:
            self.prompt = (out.prompt_logprobs, out.prompt_top_logprobs or [])
        self.meta = out.meta_info
        self.reason = out.finish_reason or self.reason


def _engine_failure(out: StreamOutput, closing: bool) -> APIError | None:
    """An output that ended in an engine error (not a stop, length limit or abort)."""
    if out.finish_reason is None or out.finish_reason["type"] != "error":
        return None
    if closing or out.finish_reason.get("closed"):
        return APIError(503, f"the server is shutting down: {out.finish_reason['message']}",
                        code="shutting_down")
    return APIError(500, out.finish_reason["message"], code="engine_error")


def create_app(engine: Any, *, served_model_name: str, api_key: str | None = None,
               max_queued_requests: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_prompts_per_request: int = DEFAULT_MAX_PROMPTS,
               tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """An app serving ``engine``; it does not own it (whoever made the engine shuts it down).
    ``tool_call_parser`` / ``reasoning_parser``: how chat output is read for tool calls
    (``tool_choice: auto``) and reasoning (chat_output.py); None: the text is content."""
    check_parsers(tool_call_parser, reasoning_parser)
    metrics = Metrics(verify_width=engine.verify_width)
    client = EngineClient(engine, metrics, max_queued_requests)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        client.begin_shutdown()          # other ASGI servers: end open streams at shutdown

    app = FastAPI(title="blockspec", version=_version(), lifespan=lifespan)
    generated = app.openapi

    def openapi() -> dict:
        """FastAPI's schema with this model's bounds: token ids below the vocabulary size,
        max_tokens below the context."""
        if app.openapi_schema is None:
            schema = copy.deepcopy(generated())     # shares dicts with the models' extras
            _model_bounds(schema, engine.config.vocab_size, engine.context_length)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    app.state.client = client
    app.state.metrics = metrics
    errors.install(app, MODELS)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics,
                       routes=ROUTES)
    speculative = engine.verify_width > 0
    tokenizer = engine.tokenizer

    def token_str(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else f"token_id:{t}"

    def token_bytes(t: int) -> list[int] | None:
        return tokenizer.token_bytes(t) if tokenizer is not None else None

    def spec_totals(choices: list[Choice]) -> tuple[int, int] | None:
        if not speculative:
            return None
        verifies = sum(c.meta.get("spec_verify_ct", 0) for c in choices)
        committed = sum((a + 1) * n for c in choices
                        for a, n in enumerate(c.meta.get("spec_accept_histogram", [])))
        return verifies, committed

    def usage_of(choices: list[Choice], n: int) -> dict:
        prompt = sum(c.meta.get("prompt_tokens", 0) for c in choices[::n])    # once per prompt
        completion = sum(len(c.ids) for c in choices)
        cached = sum(c.meta.get("cached_tokens", 0) for c in choices[::n])
        return usage(prompt, completion, spec_totals(choices), cached)

    def chunk_usage(prep: Prepared, body: Any) -> Callable[[int, Choice], dict]:
        """stream_options.continuous_usage_stats: every chunk carries choice i's usage so far;
        otherwise ``usage: null`` when the last chunk will carry it, else no key."""
        opts = body.stream_options
        if opts is not None and opts.continuous_usage_stats:
            return lambda i, c: {"usage": usage(len(prep.items[i].prompt_ids), len(c.ids), None)}
        return lambda i, c: {"usage": None} if opts is not None and opts.include_usage else {}

    def usage_tail(base: dict, n: int, wanted: bool) -> Callable[[list[Choice]], list[dict]]:
        """stream_options.include_usage: one last chunk with no choices and the usage."""
        return lambda choices: [{**base, "choices": [], "usage": usage_of(choices, n)}] if wanted else []

    def stopped() -> str:
        return (f"the server is {client.closing or 'shutting down'}; this request was stopped "
                "before it finished")

    # ---- shared streaming / collecting ------------------------------------------------------------
    async def collect(group: Group, request: Request) -> list[Choice]:
        choices = [Choice() for _ in group.rids]
        try:
            async for i, out in group.outputs(request.is_disconnected):
                failure = _engine_failure(out, client.closing is not None)
                if failure is not None:
                    raise failure
                choices[i].add(out)
        except ServerShuttingDown:
            raise APIError(503, stopped(), code="shutting_down") from None
        except ClientGone:
            raise APIError(499, "the client disconnected") from None
        finally:
            group.close()
        return choices

    async def event_stream(group: Group, render: Callable[[int, StreamOutput, Choice], list[dict]],
                           head: list[dict], tail: Callable[[list[Choice]], list[dict]],
                           ) -> AsyncIterator[str]:
        """SSE for one group: ``head`` chunks, rendered outputs, ``tail`` chunks, [DONE]. An
        engine failure or a shutdown ends the stream with an error event, then [DONE]."""
        choices = [Choice() for _ in group.rids]
        try:
            for chunk in head:
                yield sse(chunk)
            async for i, out in group.outputs():
                failure = _engine_failure(out, client.closing is not None)
                if failure is not None:
                    yield sse(failure.body())
                    yield DONE
                    return
                choices[i].add(out)
                for chunk in render(i, out, choices[i]):
                    yield sse(chunk)
            for chunk in tail(choices):
                yield sse(chunk)
            yield DONE
        except ServerShuttingDown:
            yield sse(error_body(503, stopped(), code="shutting_down"))
            yield DONE
        except Exception as e:      # noqa: BLE001 - a stream under way can only end with an event
            log.exception("a stream failed")
            yield sse(error_body(500, f"internal error: {type(e).__name__}: {e}",
                                 code=errors.INTERNAL))
            yield DONE
        finally:
            group.close()

    def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def submit(prep: Prepared, base_id: str, stream: bool) -> Group:
        return client.submit(prep.items, base_id=base_id, return_logprob=prep.return_logprob,
                             stream=stream, top_logprobs_num=prep.top_logprobs,
                             logprob_start_len=0 if prep.prompt_logprobs else -1)

    # ---- OpenAI -------------------------------------------------------------------------------------
    @app.post("/v1/completions", responses=STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prep = await run_in_threadpool(completion_inputs, body, engine, served_model_name,
                                       max_prompts_per_request)
        cid = body.rid or f"cmpl-{uuid.uuid4().hex}"
        group = submit(prep, cid, body.stream)
        created = now()
        base = {"id": cid, "object": "text_completion", "created": created, "model": served_model_name}
        want_usage = bool(body.stream_options and body.stream_options.include_usage)
        echo = [item.echo for item in prep.items]      # None, or the prompt's text per choice
        tops = prep.top_logprobs > 0

        def lp_of(lps: list, top: list, start: int, prompt: tuple | None) -> dict:
            return completion_logprobs(token_str, lps, top if tops else None, start,
                                       prompt if prep.prompt_logprobs else None)

        if body.stream:
            offsets = [0] * len(group.rids)
            extra = chunk_usage(prep, body)

            def render(i: int, out: StreamOutput, c: Choice) -> list[dict]:
                first = echo[i] is not None
                if not (out.text or out.finished or first or (prep.return_logprob and out.logprobs)):
                    return []
                text, echo[i] = (echo[i] or "") + out.text, None
                lp = None
                if prep.return_logprob:
                    prompt = c.prompt if first else None
                    lp = lp_of(out.logprobs, out.top_logprobs, offsets[i], prompt)
                    offsets[i] += sum(len(s) for s in lp["tokens"])
                choice = {"index": i, "text": text, "logprobs": lp,
                          "finish_reason": finish_reason(out.finish_reason)}
                return [{**base, "choices": [choice], **extra(i, c)}]

            return sse_response(event_stream(group, render, [],
                                             usage_tail(base, prep.n, want_usage)))
        choices = await collect(group, request)
        return JSONResponse({**base, "choices": [
            {"index": i, "text": (echo[i] or "") + c.text, "finish_reason": finish_reason(c.reason),
             "logprobs": lp_of(c.logprobs, c.tops, 0, c.prompt) if prep.return_logprob else None}
            for i, c in enumerate(choices)], "usage": usage_of(choices, prep.n)})

    @app.post("/v1/chat/completions", responses=STREAMED)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prep = await run_in_threadpool(chat_inputs, body, engine, served_model_name,
                                       max_prompts_per_request)
        cid = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
        group = submit(prep, cid, body.stream)
        base = {"id": cid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": now(), "model": served_model_name}
        want_usage = bool(body.stream_options and body.stream_options.include_usage)
        shapers = [ChoiceOutput(prep.chat or ChatSpec(), tool_call_parser, reasoning_parser)
                   for _ in group.rids]
        if body.stream:
            extra = chunk_usage(prep, body)
            head = [{**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}],
                     **extra(i, Choice())} for i in range(len(group.rids))]

            def render(i: int, out: StreamOutput, c: Choice) -> list[dict]:
                delta = stream_delta(shapers[i], out.text, out.finished)
                if not (delta or out.finished or (prep.return_logprob and out.logprobs)):
                    return []
                choice = {"index": i, "delta": delta,
                          "logprobs": chat_logprobs(token_str, out.logprobs, out.top_logprobs,
                                                    token_bytes)
                          if prep.return_logprob else None,
                          "finish_reason": shapers[i].finish_reason(out.finish_reason)}
                return [{**base, "choices": [choice], **extra(i, c)}]

            return sse_response(event_stream(group, render, head,
                                             usage_tail(base, prep.n, want_usage)))
        choices = await collect(group, request)
        return JSONResponse({**base, "choices": [
            {"index": i, "message": shapers[i].message(c.text),
             "logprobs": (chat_logprobs(token_str, c.logprobs, c.tops, token_bytes)
                          if prep.return_logprob else None),
             "finish_reason": shapers[i].finish_reason(c.reason)}
            for i, c in enumerate(choices)], "usage": usage_of(choices, prep.n)})

    def get_and_head(path: str, **kw: Any) -> Callable:
        """GET, and HEAD answering the same status without a body (not in the schema)."""
        def register(fn: Callable) -> Callable:
            app.head(path, include_in_schema=False)(fn)
            return app.get(path, **kw)(fn)
        return register

    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": now(),
                "owned_by": "blockspec", "max_model_len": engine.context_length}

    @get_and_head("/v1/models", responses=ANY_ROUTE)
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @get_and_head("/v1/models/{model_id:path}", responses={**ANY_ROUTE, **_errors(404)})
    async def model(model_id: str) -> dict:
        check_model(model_id, served_model_name)
        return model_card()

    add_tokenize_routes(app, engine, served_model_name, POSTED)

    # ---- sglang native --------------------------------------------------------------------------
    @app.post("/generate", responses=STREAMED)
    async def generate(body: GenerateRequest, request: Request) -> Response:
        single, items, rids = await run_in_threadpool(generate_inputs, body, engine,
                                                      max_prompts_per_request)
        base_id = rids[0] if rids and single else f"gen-{uuid.uuid4().hex}"
        group = client.submit(items, base_id=base_id, return_logprob=body.return_logprob,
                              stream=body.stream, rids=rids, top_logprobs_num=body.top_logprobs_num,
                              logprob_start_len=body.logprob_start_len)

        if body.stream:      # sglang's shape: cumulative text and ids in every chunk
            def render(i: int, out: StreamOutput, c: Choice) -> list[dict]:
                chunk = {"text": c.text, "output_ids": list(c.ids), "meta_info": out.meta_info}
                return [chunk if single else {**chunk, "index": i}]

            return sse_response(event_stream(group, render, [], lambda _: []))
        choices = await collect(group, request)
        results = [{"text": c.text, "output_ids": c.ids, "meta_info": c.meta} for c in choices]
        return JSONResponse(results[0] if single else results)

    @app.post("/abort_request", responses=POSTED)
    async def abort_request(body: AbortRequest) -> dict:
        if body.rid is None and not body.abort_all:
            raise APIError(400, "give rid or abort_all=true", param="rid")
        hits = await client.abort(body.rid, abort_all=body.abort_all)
        if not hits and not body.abort_all:
            raise APIError(404, f"no running request has id {body.rid!r}", param="rid",
                           code="request_not_found")
        return {"aborted": hits}

    # ---- operations ---------------------------------------------------------------------------------
    @get_and_head("/health", responses={**ANY_ROUTE, **_errors(503)})
    async def health() -> Response:
        if client.closing is not None or client.draining or not engine.stats().alive:
            return error_response(503, "the engine loop is not running"
                                  if not engine.stats().alive else "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @get_and_head("/metrics", response_class=PlainTextResponse, responses={
        **ANY_ROUTE, 200: {"description": "Prometheus text format",
                           "content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def metrics_route() -> Response:
        return Response(metrics.render(engine.stats()), media_type=CONTENT_TYPE)

    return app


def _model_bounds(schema: dict, vocab: int, context: int) -> None:
    """Put the served model's vocabulary and context into the request schemas, in place."""
    def walk(node: Any, field: str | None) -> None:
        if isinstance(node, dict):
            if (field in ("prompt", "input_ids", "stop_token_ids")
                    and node.get("type") == "integer" and "minimum" in node):
                node["maximum"] = vocab - 1
            if field in ("max_tokens", "max_completion_tokens") and node.get("type") == "integer":
                node["maximum"] = context - 1
            for key, value in node.items():
                walk(value, key if key not in ("anyOf", "items", "not") else field)
        elif isinstance(node, list):
            for value in node:
                walk(value, field)

    for body in schema.get("components", {}).get("schemas", {}).values():
        for name, prop in body.get("properties", {}).items():
            walk(prop, name)


def _version() -> str:
    return __version__
