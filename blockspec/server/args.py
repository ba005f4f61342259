"""``blockspec serve`` flags: every EngineArgs flag plus the server's own (ServerArgs). Kept free
of heavy imports so ``blockspec --help`` stays fast; the server loads only when it runs."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from blockspec.flags import HelpFormatter, engine_flags

# the parsers' names (tool_parser.PARSERS, reasoning.REASONING_PARSERS; tests check they agree),
# spelled here so the CLI's help stays free of server imports
TOOL_CALL_PARSERS = ("qwen3_coder", "hermes")
REASONING_PARSERS = ("nemotron_3",)
ALIASES = {"dp_size": ("--data-parallel-size",)}      # sglang's other spelling


def _arg(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ServerArgs:
    host: str = _arg("127.0.0.1", "address to bind; 127.0.0.1 serves this machine only, 0.0.0.0 "
                                  "every interface")
    port: int = _arg(30000, "TCP port; 0 picks a free one (the address is printed at start)")
    api_key: str | None = _arg(None, "require 'Authorization: Bearer KEY' on every route except "
                                     "/health and /metrics; unset: no key")
    served_model_name: str | None = _arg(None, "model name in /v1/models and in responses; "
                                               "unset: the model folder's name")
    max_queued_requests: int | None = _arg(None, "answer 429 once this many requests wait for "
                                                 "cache; unset: no limit")
    max_request_bytes: int = _arg(32 * 1024 * 1024, "largest request body; larger ones get 413")
    max_prompts_per_request: int = _arg(256, "most sequences (prompts x n) one request may ask "
                                             "for; more get 400. Admission shares the engine "
                                             "out between requests round-robin either way")
    graceful_shutdown_timeout: float = _arg(10.0, "after SIGINT/SIGTERM: seconds the running "
                                                  "and queued requests get to finish (new ones "
                                                  "get 503); then the rest end with an error")
    dp_size: int = _arg(1, "data-parallel replicas of the engine behind this server (each its "
                           "own model copy and cache; on CUDA replica i on the i-th GPU); "
                           "requests are routed by prefix (with --enable-radix-cache) and load")
    tool_call_parser: str | None = _arg(None, "read tool calls out of chat output (tool_choice "
                                              "auto) in this format; unset: tools reach the "
                                              "template, the output stays content",
                                        TOOL_CALL_PARSERS)
    reasoning_parser: str | None = _arg(None, "split <think>...</think> off chat output into "
                                              "reasoning_content; unset: it stays content",
                                        REASONING_PARSERS)

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        for name in ("max_queued_requests", "max_request_bytes", "max_prompts_per_request",
                     "dp_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS),
                            ("reasoning_parser", REASONING_PARSERS)):
            value = getattr(self, name)
            if value is not None and value not in known:
                raise ValueError(f"--{name.replace('_', '-')} must be one of "
                                 f"{', '.join(known)}, got {value!r}")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0, "
                             f"got {self.graceful_shutdown_timeout}")


def add_serve_parser(sub: Any) -> None:
    """Add ``serve`` to the CLI's subparsers: the EngineArgs flags, then ServerArgs'."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter,
                       description="Serve the model over HTTP: /v1/completions, "
                                   "/v1/chat/completions, /v1/models, /generate, /abort_request, "
                                   "/health, /metrics. Stops gracefully on SIGINT/SIGTERM.")
    engine_flags(p)
    for f in fields(ServerArgs):
        kind = {"int": int, "int | None": int, "float": float}.get(f.type, str)
        default = f.default if f.default is not MISSING else None
        p.add_argument("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ()), type=kind,
                       default=default,
                       help=f.metadata["help"], choices=f.metadata["choices"])


def server_args(ns: argparse.Namespace) -> ServerArgs:
    args = ServerArgs(**{f.name: getattr(ns, f.name) for f in fields(ServerArgs)})
    args.validate()
    return args
