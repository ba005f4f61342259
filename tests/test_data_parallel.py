"""--dp-size: two engine replicas behind one server. Concurrent requests through the official
openai client get the answers a single engine gives, both replicas serve, the router keeps a
shared prefix on one replica (prefix cache on) and spreads unrelated prompts by load, and
/metrics adds the replicas up."""
from __future__ import annotations

import asyncio

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from blockspec import Engine  # noqa: E402
from blockspec.engine.data_parallel import (MIN_SHARED_TOKENS, DataParallelEngine,  # noqa: E402
                                            Router, prefix_hashes)
from blockspec.sampling import SamplingParams  # noqa: E402
from blockspec.server.launch import ServerThread  # noqa: E402
from tests.spec_fixtures import CHARS, make_spec_target, write_char_tokenizer  # noqa: E402

VOCAB = 24
MODEL = "dp"


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    write_char_tokenizer(folder, VOCAB)
    kw = {"model_path": str(folder), "device": "cpu", "max_running_requests": 8}
    engine = DataParallelEngine.build(2, enable_radix_cache=True, page_size=4,
                                      mamba_track_interval=16, **kw)
    single = Engine(**kw)
    server = ServerThread(engine, served_model_name=MODEL)
    yield server.url, engine, single
    server.stop()
    engine.shutdown()
    single.shutdown()


def _prompts() -> list[str]:
    letters = CHARS[:VOCAB]
    return ["".join(letters[(5 * i + 3 * k) % VOCAB] for k in range(3 + i % 6)) for i in range(24)]


async def _complete_all(url: str, prompts: list[str]) -> list[str]:
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=300)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                http_client=http)

    async def one(i: int, prompt: str) -> str:
        kw = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i}
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6 + i % 5,
                                            extra_body={"ignore_eos": True}, **kw)
        return r.choices[0].text
    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await http.aclose()


def test_concurrent_requests_get_single_engine_answers_from_both_replicas(dp):
    url, engine, single = dp
    prompts = _prompts()
    before = [e.stats().steps for e in engine.replicas]
    got = asyncio.run(_complete_all(url, prompts))
    tok = single.tokenizer
    for i, (prompt, text) in enumerate(zip(prompts, got)):
        params = {"max_new_tokens": 6 + i % 5, "ignore_eos": True}
        params.update({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i})
        want = single.generate(input_ids=tok.encode(prompt), sampling_params=params)
        assert text == tok.decode(want["output_ids"]), f"prompt {i}"
    steps = [e.stats().steps - b for e, b in zip(engine.replicas, before)]
    assert all(s > 0 for s in steps), f"a replica served nothing: {steps}"
    assert engine.router.in_flight == [0, 0]
    metrics = httpx.get(url + "/metrics").text
    total = sum(e.stats().steps for e in engine.replicas)
    assert any(line.split()[-1] in (str(total), f"{float(total)}") for line in metrics.splitlines()
               if line.startswith("blockspec") and "steps" in line), "steps not summed"


def test_router_keeps_a_shared_prefix_on_one_replica_and_spreads_by_load():
    r = Router(2, cache_aware=True, page=4)
    shared = list(range(MIN_SHARED_TOKENS))
    first = r.pick(shared + [1, 2, 3, 4])
    other = r.pick([7] * 64)                     # unrelated: the less loaded replica
    assert other != first
    assert r.pick(shared + [9, 9, 9, 9]) == first  # the shared prefix follows its replica
    r.done(first), r.done(first), r.done(other)
    short = Router(2, cache_aware=True, page=4)
    a = short.pick(list(range(8)))
    assert short.pick(list(range(8))) != a       # below MIN_SHARED_TOKENS: load decides
    blind = Router(2, cache_aware=False, page=4)
    assert [blind.pick(shared) for _ in range(4)] == [0, 1, 0, 1]
    assert prefix_hashes(list(range(10)), 4)[:2] == prefix_hashes(list(range(8)), 4)


def test_busy_replica_loses_its_prefix_affinity():
    r = Router(2, cache_aware=True, page=4)
    shared = list(range(MIN_SHARED_TOKENS))
    home = r.pick(shared)
    for _ in range(6):                           # the home replica gets busy
        r.in_flight[home] += 1
    assert r.pick(shared + [5, 5, 5, 5]) != home


def test_dp_with_tp_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tp-size"):
        DataParallelEngine.build(2, model_path=str(tmp_path), tp_size=2)


def test_abort_reaches_the_replica_and_unknown_ids_are_refused(dp):
    _, engine, _ = dp
    done = []
    rid = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=10_000 // 100, ignore_eos=True),
                        done.append, rid="dp-abort")
    with pytest.raises(ValueError, match="already in use"):
        engine.submit([1, 2, 3], SamplingParams(max_new_tokens=4), done.append, rid="dp-abort")
    engine.abort(rid, 10.0)
    assert not engine.abort("no-such-request")
    for _ in range(200):
        if engine.router.in_flight == [0, 0]:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert engine.router.in_flight == [0, 0] and done and done[-1].finished
