"""A careless client against a real ``blockspec serve`` on 127.0.0.1: over a thousand malformed
requests (broken JSON, wrong types, values past every range, lone surrogates, unknown fields,
wrong methods and content types, oversized bodies) mixed with valid concurrent ones. No answer
is a server error, no connection is dropped, every error is OpenAI-shaped, and every valid
request's output equals its run alone. Bounded in time (the request count and a deadline)."""
from __future__ import annotations

import asyncio
import copy
import json
import random
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from blockspec.tiny_model import write_tiny_model  # noqa: E402
from tests.test_serve_cli import _Proc  # noqa: E402

MALFORMED = 1100
WORKERS = 12
DEADLINE_S = 150.0
MAX_BODY = 64 * 1024

BASES = {
    "/v1/completions": {"prompt": "hello there", "max_tokens": 6, "temperature": 0,
                        "ignore_eos": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                             "temperature": 0},
    "/generate": {"text": "hey", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    "/abort_request": {"rid": "nobody"},
}
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
          "stop_token_ids", "seed", "n", "stream", "stream_options", "logprobs", "echo",
          "presence_penalty", "logit_bias", "rid", "user", "model", "messages", "text",
          "input_ids", "sampling_params", "return_logprob", "best_of", "suffix", "top_logprobs",
          "max_completion_tokens", "abort_all", "ignore_eos", "temprature", "\ud800"]
WEIRD = [None, True, False, -1, 0, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308,
         1.5, -0.0, "", "x", "\ud800", "a\udfffb", "\x00", "😀" * 3, [], [0], [-1], [10**20],
         [[]], [[1, 2], [3]], ["a", 3], {}, {"a": 1}, {"\ud800": 1}, [{"role": "user"}],
         [{"role": "user", "content": "\udc00"}], [{"role": "tool", "content": "x"}],
         {"max_new_tokens": 2**70}, {"top_k": 2**63}, {"stop": ["\ud800"]}, {"seed": -5},
         {"stop_token_ids": [99999]}, [1] * 300, ["p"] * 300, "y" * 3000]
VALID = [
    ("/v1/completions", {"prompt": "The cat", "max_tokens": 12, "temperature": 0,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": [5, 17, 33, 8], "max_tokens": 10, "temperature": 0.8,
                         "seed": 7, "ignore_eos": True, "logprobs": 0}),
    ("/v1/completions", {"prompt": ["a", "bc"], "max_tokens": 8, "temperature": 0.7, "seed": 3,
                         "n": 2, "ignore_eos": True, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello!"}],
                              "max_tokens": 10, "temperature": 0, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi"}],
                              "max_tokens": 9, "temperature": 0.9, "seed": 11}),
    ("/generate", {"input_ids": [[3, 4, 5], [9, 9]], "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}),
    ("/generate", {"text": "abc", "stream": True, "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True}}),
]


def _mutate(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body bytes, headers) of one malformed request."""
    path = rng.choice(list(BASES))
    body = copy.deepcopy(BASES[path])
    headers = {"Content-Type": "application/json"}
    kind = rng.randrange(12)
    if kind <= 4:                                   # one or two fields set to odd values
        for _ in range(rng.choice((1, 1, 2))):
            field = rng.choice(FIELDS)
            if field in ("max_tokens", "max_completion_tokens"):
                body[field] = rng.choice([0, -1, 2**63, 10**30, "8", None, 1.5, [8]])
            else:
                body[field] = rng.choice(WEIRD)
    elif kind == 5:                                 # a required field gone, or the body empty
        body = {} if rng.random() < 0.3 else {k: v for k, v in body.items()
                                              if k not in ("prompt", "messages", "text", "rid")}
    elif kind == 6:                                 # broken bytes
        raw = json.dumps(body).encode()
        cut = rng.randrange(len(raw))
        choices = [raw[:cut], raw[:cut] + b"\xff\xfe" + raw[cut:], b"\x00" * 8, b"",
                   raw.replace(b'"', b"'"), b"[" * 50000, b'{"a":' * 30000,
                   b'{"prompt": ' + b"9" * 5000 + b"}", b'{"prompt": NaN, "max_tokens": Infinity}',
                   b"\xed\xa0\x80", rng.randbytes(64)]
        return "POST", path, rng.choice(choices), headers
    elif kind == 7:                                 # wrong method, path or content type
        choice = rng.randrange(4)
        if choice == 0:
            return rng.choice(["GET", "PUT", "DELETE", "PATCH"]), path, b"", {}
        if choice == 1:
            return "POST", rng.choice(["/v1/embeddings", "/v1", "/generate/x", "/%ff"]), b"{}", \
                headers
        if choice == 2:
            return "POST", path, json.dumps(body).encode(), {"Content-Type": "text/plain"}
        return "GET", rng.choice(["/v1/models", "/health", "/metrics", "/openapi.json"]), b"", {}
    elif kind == 8:                                 # too large
        body["prompt"] = "z" * (MAX_BODY + 10)
    elif kind == 9:                                 # a shape nested one level wrong
        if path == "/v1/chat/completions":
            body["messages"] = [rng.choice(WEIRD)]
        elif path == "/generate":
            body["sampling_params"] = rng.choice(WEIRD)
        else:
            body["stream_options"] = rng.choice(WEIRD)
    elif kind == 10:                                # too many prompts
        body.pop("text", None)
        body["prompt" if path != "/generate" else "input_ids"] = [[1, 2]] * 300
    else:                                           # the same request id twice, at once
        body["rid"] = f"dup-{rng.randrange(3)}"
        body["max_tokens"] = body.get("max_tokens", 6)
    return "POST", path, json.dumps(body).encode(), headers


def _result(path: str, r: httpx.Response) -> object:
    """What a valid request produced: texts or token ids, in choice order."""
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(x[6:]) for x in r.text.splitlines()
                  if x.startswith("data: ") and x != "data: [DONE]"]
        assert all("error" not in e for e in events), events
        if path == "/generate":
            last = {}
            for e in events:
                last[e.get("index", 0)] = e["output_ids"]
            return [last[i] for i in sorted(last)]
        out: dict[int, str] = {}
        for e in events:
            for c in e["choices"]:
                out[c["index"]] = out.get(c["index"], "") + (
                    c.get("text") or (c.get("delta") or {}).get("content") or "")
        return [out[i] for i in sorted(out)]
    body = r.json()
    if path == "/generate":
        return [g["output_ids"] for g in body]
    return [c.get("text", c.get("message", {}).get("content")) for c in body["choices"]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("fuzz") / "demo")
    proc = _Proc("--model-path", str(folder), "--device", "cpu", "--port", "0",
                 "--max-request-bytes", str(MAX_BODY), "--max-running-requests", "16")
    try:
        yield proc.url()
    finally:
        proc.p.terminate()
        proc.p.wait(60)
        proc.kill()


def test_fuzz_no_server_error_no_dropped_connection_valid_outputs_unharmed(server):
    solo = []
    with httpx.Client(base_url=server, timeout=60) as c:
        for path, body in VALID:
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            solo.append(_result(path, r))
    rng = random.Random(24)
    jobs: list[tuple] = [("bad", *_mutate(rng)) for _ in range(MALFORMED)]
    for i, (path, body) in enumerate(VALID * 3):      # spread through the malformed ones
        jobs.insert((i + 1) * len(jobs) // (len(VALID) * 3 + 1), ("ok", i % len(VALID), path, body))
    stats = {"sent": 0, "errors_5xx": [], "dropped": [], "shape": [], "valid_wrong": []}
    start = time.monotonic()

    async def worker(queue: asyncio.Queue) -> None:
        async with httpx.AsyncClient(base_url=server, timeout=60,
                                     limits=httpx.Limits(max_connections=1)) as client:
            while not queue.empty() and time.monotonic() - start < DEADLINE_S:
                job = queue.get_nowait()
                stats["sent"] += 1
                try:
                    if job[0] == "ok":
                        _, i, path, body = job
                        r = await client.post(path, json=body)
                        if r.status_code != 200 or _result(path, r) != solo[i]:
                            stats["valid_wrong"].append((path, body, r.status_code, r.text[:300]))
                        continue
                    _, method, path, raw, headers = job
                    r = await client.request(method, path, content=raw, headers=headers)
                except httpx.TransportError as e:
                    stats["dropped"].append((job[:3], repr(e)))
                    continue
                if r.status_code >= 500:
                    stats["errors_5xx"].append((method, path, raw[:200], r.text[:300]))
                elif r.status_code >= 400:
                    try:
                        err = r.json()["error"]
                        ok = set(err) == {"message", "type", "param", "code"} and err["message"]
                    except Exception:       # noqa: BLE001 - counted below
                        ok = False
                    if not ok:
                        stats["shape"].append((method, path, raw[:200], r.status_code, r.text[:200]))

    async def main() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        await asyncio.gather(*(worker(queue) for _ in range(WORKERS)))

    asyncio.run(main())
    elapsed = time.monotonic() - start
    assert stats["sent"] == len(jobs), (stats["sent"], len(jobs), elapsed)   # within the deadline
    assert not stats["errors_5xx"], stats["errors_5xx"][:5]
    assert not stats["dropped"], stats["dropped"][:5]
    assert not stats["shape"], stats["shape"][:5]
    assert not stats["valid_wrong"], stats["valid_wrong"][:3]
    health = httpx.get(server + "/health", timeout=10)
    assert health.status_code == 200
