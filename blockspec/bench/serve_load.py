"""Loopback load test of ``blockspec serve``: N concurrent short streaming completions through the
official ``openai`` client; end-to-end latency and time-to-first-token percentiles, output
tokens/s over the wall time, and the error count.

    python -m blockspec.bench.serve_load [--url http://127.0.0.1:30000 --api-key K]
        [--requests 200 --max-tokens 16 --max-running-requests 64]

Without --url it serves the default model (the shipped demo family, DFLASH on) in-process on
127.0.0.1 (CPU unless told)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from typing import Any

from blockspec.bench.stats import percentile
from blockspec.engine import Engine
from blockspec.server.launch import ServerThread


async def run_load(url: str, *, requests: int = 200, max_tokens: int = 16,
                   api_key: str | None = None, model: str | None = None,
                   timeout: float = 300.0) -> dict[str, Any]:
    """Start ``requests`` streaming completions at once and wait for all of them."""
    # lazy: optional dependencies (the server extra)
    import httpx
    import openai

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=requests,
                                                 max_keepalive_connections=requests),
                             timeout=timeout)
    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none",
                                max_retries=0, http_client=http)
    if model is None:
        model = (await client.models.list()).data[0].id
    start = asyncio.Event()

    async def one(i: int) -> tuple[float, float, int]:
        await start.wait()
        t0 = time.perf_counter()
        ttft, tokens = math.nan, 0
        stream = await client.completions.create(
            model=model, prompt=f"load {i}: the quick brown fox", max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and math.isnan(ttft):
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return time.perf_counter() - t0, ttft, tokens

    tasks = [asyncio.create_task(one(i)) for i in range(requests)]
    t0 = time.perf_counter()
    start.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.perf_counter() - t0
    await client.close()
    await http.aclose()
    ok = [r for r in results if not isinstance(r, BaseException)]
    errors = [f"{r!r} <- {r.__cause__!r}" if r.__cause__ else repr(r)
              for r in results if isinstance(r, BaseException)]
    lat, ttfts = [r[0] for r in ok], [r[1] for r in ok if not math.isnan(r[1])]
    out_tokens = sum(r[2] for r in ok)
    return {"requests": requests, "completed": len(ok), "errors": len(errors),
            "error_samples": errors[:3], "max_tokens": max_tokens, "wall_s": round(wall, 3),
            "latency_p50_s": round(percentile(lat, 50), 4),
            "latency_p99_s": round(percentile(lat, 99), 4),
            "ttft_p50_s": round(percentile(ttfts, 50), 4),
            "ttft_p99_s": round(percentile(ttfts, 99), 4),
            "output_tokens": out_tokens, "output_tok_per_s": round(out_tokens / wall, 1),
            "short_outputs": sum(1 for r in ok if r[2] != max_tokens)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blockspec.bench.serve_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server; unset: serve the demo model in-process")
    p.add_argument("--api-key")
    p.add_argument("--model", help="model name; unset: the first of /v1/models")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=64, help="in-process server only")
    p.add_argument("--device", default="cpu", help="in-process server only")
    ns = p.parse_args(argv)
    if ns.url:
        result = asyncio.run(run_load(ns.url, requests=ns.requests, max_tokens=ns.max_tokens,
                                      api_key=ns.api_key, model=ns.model))
    else:
        engine = Engine(device=ns.device, max_running_requests=ns.max_running_requests)
        try:
            with ServerThread(engine) as url:
                asyncio.run(run_load(url, requests=8, max_tokens=4))             # warm-up
                result = asyncio.run(run_load(url, requests=ns.requests, max_tokens=ns.max_tokens))
                result["engine_steps"] = engine.stats().steps
        finally:
            engine.shutdown()
        result["server"] = (f"in-process demo model, {ns.device}, "
                            f"max_running_requests={ns.max_running_requests}")
    print(json.dumps(result))
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
