"""vLLM's /tokenize and /detokenize: clients (lm-eval among them) count and check tokens with
the served model's own tokenizer and chat template instead of guessing one locally."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from blockspec.engine.engine import check_token_ids
from blockspec.server import tools
from blockspec.server.errors import APIError
from blockspec.server.protocol import DetokenizeRequest, TokenizeRequest
from blockspec.server.validate import check_model, engine_checked, tokenizer_of
from blockspec.tokenizer import TokenizerError

ROUTES = frozenset({"/tokenize", "/detokenize"})


def add_tokenize_routes(app: FastAPI, engine: Any, served: str, responses: dict) -> None:
    @app.post("/tokenize", responses=responses)
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model, served)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.prompt is not None:
            tok = tokenizer_of(engine, "prompt")
            text = body.prompt
            specials = True if body.add_special_tokens is None else body.add_special_tokens
        else:
            tok = tokenizer_of(engine, "messages")
            if not body.messages:
                raise APIError(400, "messages is empty: give at least one message",
                               param="messages")
            if not tok.chat_template:
                raise APIError(400, "this model's tokenizer has no chat template",
                               param="messages")
            try:
                text = tok.apply_chat_template(tools.template_messages(body),
                                               add_generation_prompt=body.add_generation_prompt,
                                               **(body.chat_template_kwargs or {}))
            except TokenizerError as e:
                raise APIError(400, str(e), param="messages") from None
            specials = bool(body.add_special_tokens)
        ids = tok.encode(text, add_special_tokens=specials)
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids,
                "token_strs": [tok.piece(t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize", responses=responses)
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model, served)
        tok = tokenizer_of(engine, "tokens")
        engine_checked(lambda: check_token_ids(body.tokens, engine.config.vocab_size, "tokens",
                                               allow_empty=True))
        return {"prompt": tok.decode(body.tokens)}
