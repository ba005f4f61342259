"""Running the app: ``blockspec serve`` in the foreground (graceful on SIGINT/SIGTERM) or a
``ServerThread`` in the background (tests, embedding). Either way the listening socket is bound
here first, so a busy port is one clear error instead of uvicorn exiting the process."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import uvicorn

from blockspec.args import EngineArgs
from blockspec.demo_family import describe
from blockspec.engine import Engine
from blockspec.engine.data_parallel import DataParallelEngine
from blockspec.engine.worker_node import run_worker_node
from blockspec.server.app import create_app
from blockspec.server.args import ServerArgs, server_args
from blockspec.server.client import EngineClient

log = logging.getLogger("blockspec")


class _Server(uvicorn.Server):
    """uvicorn, plus: say where it listens once it does, and drain on shutdown: stop accepting
    and refuse new requests at once, give the running and queued ones up to
    --graceful-shutdown-timeout to finish (streams to send their last chunk), then end the rest
    with a clear error (an error event and [DONE] for a stream, 503 otherwise) before uvicorn
    waits for the connections, so shutdown never waits longer than that."""

    FLUSH_S = 5.0           # for the ended requests' last bytes to reach their clients

    def __init__(self, config: uvicorn.Config, client: EngineClient,
                 on_started: Callable[[str], None] | None) -> None:
        super().__init__(config)
        self.client, self.on_started = client, on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_started(f"http://{host if ':' not in host else f'[{host}]'}:{port}")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.client.begin_drain()
        for server in self.servers:
            server.close()                      # no new connections
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()               # idle ones close, busy ones after their answer
        drain = self.config.timeout_graceful_shutdown or 0.0
        loop = asyncio.get_running_loop()
        end = loop.time() + drain
        while self.client.groups and loop.time() < end and not self.force_exit:
            await asyncio.sleep(0.05)
        if self.client.groups:
            pending = sum(len(g.pending) for g in self.client.groups.values())
            log.warning("graceful shutdown: %d request(s) still running after %g s; ending them",
                        pending, drain)
        self.client.begin_shutdown(f"shutting down: requests get {drain:g} s to finish "
                                   "(--graceful-shutdown-timeout)")
        self.config.timeout_graceful_shutdown = self.FLUSH_S
        await super().shutdown(sockets)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def served_name(engine: Any, args: ServerArgs) -> str:
    return args.served_model_name or Path(engine.args.model_path).name


def build_server(engine: Any, args: ServerArgs,
                 on_started: Callable[[str], None] | None = None) -> _Server:
    app = create_app(engine, served_model_name=served_name(engine, args), api_key=args.api_key,
                     max_queued_requests=args.max_queued_requests,
                     max_body_bytes=args.max_request_bytes,
                     max_prompts_per_request=args.max_prompts_per_request,
                     tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    config = uvicorn.Config(app, log_level=engine.args.log_level.lower(), access_log=False,
                            lifespan="on", timeout_graceful_shutdown=args.graceful_shutdown_timeout)
    return _Server(config, app.state.client, on_started)


def run(ns: argparse.Namespace) -> int:
    """``blockspec serve``: build the engine, serve until SIGINT/SIGTERM, shut down cleanly."""
    sargs = server_args(ns)
    engine_kwargs = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)
                     if f.name != "extra" and hasattr(ns, f.name)}
    if engine_kwargs.get("node_rank", 0) > 0:      # this node runs its ranks; node 0 serves
        print(f"blockspec serve: node {ns.node_rank} of {ns.nnodes}, tensor-parallel ranks only "
              f"(rendezvous {ns.dist_init_addr})", file=sys.stderr, flush=True)
        run_worker_node(**engine_kwargs)
        print("blockspec serve: stopped (node 0 shut the ranks down)", file=sys.stderr, flush=True)
        return 0
    sock = bind(sargs.host, sargs.port)          # a busy port fails before the model loads
    try:
        engine = (Engine(**engine_kwargs) if sargs.dp_size == 1
                  else DataParallelEngine.build(sargs.dp_size, **engine_kwargs))
    except BaseException:
        sock.close()
        raise
    try:
        if ns.model_path is None:
            a = engine.args
            line = describe(a.model_path, a.speculative_algorithm, a.speculative_draft_model_path)
            print(f"blockspec serve: {line}", file=sys.stderr, flush=True)
        name = served_name(engine, sargs)
        server = build_server(engine, sargs, on_started=lambda url: print(
            f"blockspec serve: {name} on {url} (OpenAI API at {url}/v1)", file=sys.stderr,
            flush=True))
        received: list[int] = []

        def on_signal(sig: int, _frame: object) -> None:
            # Before uvicorn takes the signals: stop as soon as it starts. After: uvicorn
            # re-raises the signal it handled once it has shut down, and it lands here.
            received.append(sig)
            server.should_exit = True

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[sock])
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            sock.close()
    finally:
        engine.shutdown()
    why = f" ({signal.Signals(received[0]).name})" if received else ""
    print(f"blockspec serve: stopped{why}", file=sys.stderr, flush=True)
    return 0


class ServerThread:
    """A real server on a background thread: ``with ServerThread(engine) as url: ...``."""

    def __init__(self, engine: Any, args: ServerArgs | None = None, **overrides: Any) -> None:
        args = args or ServerArgs(port=0)
        for k, v in overrides.items():
            setattr(args, k, v)
        args.validate()
        self.url: str | None = None
        started = threading.Event()

        def on_started(url: str) -> None:
            self.url = url
            started.set()

        self._sock = bind(args.host, args.port)
        self.server = build_server(engine, args, on_started)
        self.app = self.server.config.app
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="blockspec-http", daemon=True)
        self._thread.start()
        if not started.wait(60) or self.url is None:
            raise RuntimeError("the server did not start within 60 s")

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.stop()
