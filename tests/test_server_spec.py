"""A DFLASH server under 64 concurrent streams: a tiny low-entropy target with a character
tokenizer (text <-> ids one to one) and a random draft that is accepted often (tests/spec_fixtures.py)."""
from __future__ import annotations

import asyncio
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from blockspec import Engine  # noqa: E402
from blockspec.server.launch import ServerThread  # noqa: E402
from tests.spec_fixtures import (CHARS, draft_config, make_spec_target, write_char_tokenizer,  # noqa: E402
                                 write_draft)

VOCAB, HIDDEN, LAYERS, BLOCK = 24, 32, 7, 4
MODEL = "spec"


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_spec")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    write_char_tokenizer(folder, VOCAB)
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=BLOCK)
    draft = write_draft(root / "draft", cfg, std=0.05)
    engine = Engine(model_path=str(folder), device="cpu", speculative_algorithm="DFLASH",
                    speculative_draft_model_path=str(draft), max_running_requests=32)
    offline = Engine(model_path=str(folder), device="cpu")          # target only, no draft
    server = ServerThread(engine, served_model_name=MODEL)
    yield server.url, offline
    server.stop()
    engine.shutdown()
    offline.shutdown()


def _jobs() -> list[dict]:
    letters = CHARS[:VOCAB]
    jobs = []
    for i in range(64):
        prompt = "".join(letters[(3 * i + 5 * k) % VOCAB] for k in range(2 + i % 5))
        job = {"i": i, "prompt": prompt, "max_tokens": 8 + (7 * i) % 41}
        job.update({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i})
        jobs.append(job)
    return jobs


async def _stream_all(url: str, jobs: list[dict]) -> list[tuple[str, object]]:
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=128), timeout=300)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=http)

    async def one(job: dict) -> tuple[str, object]:
        kw = {k: job[k] for k in ("temperature", "top_p", "seed") if k in job}
        stream = await client.completions.create(
            model=MODEL, prompt=job["prompt"], max_tokens=job["max_tokens"], stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **kw)
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage

    try:
        return await asyncio.gather(*(one(j) for j in jobs))
    finally:
        await client.close()
        await http.aclose()


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(blockspec_spec_\S+) (\S+)$", text, re.M)}


def test_64_concurrent_streams_with_dflash(spec):
    url, offline = spec
    jobs = _jobs()
    before = _metrics(url)
    results = asyncio.run(_stream_all(url, jobs))
    after = _metrics(url)
    for job, (text, usage) in zip(jobs, results):
        assert len(text) == job["max_tokens"] == usage.completion_tokens, job
        assert usage.spec_verify_ct > 0 and 1.0 <= usage.spec_accept_length <= BLOCK
    greedy = [j for j in jobs if j["temperature"] == 0.0]
    want = offline.generate(prompt=[j["prompt"] for j in greedy], sampling_params=[
        {"max_new_tokens": j["max_tokens"], "temperature": 0.0, "ignore_eos": True} for j in greedy])
    assert [results[j["i"]][0] for j in greedy] == [w["text"] for w in want]   # = target-only greedy
    seeded = [j for j in jobs if "seed" in j][::-1]                           # other order, other batches
    again = asyncio.run(_stream_all(url, seeded))
    assert [t for t, _ in again] == [results[j["i"]][0] for j in seeded]
    # the accept-length histogram moved, by exactly the verifies the responses report
    verifies = sum(u.spec_verify_ct for _, u in results)
    count = "blockspec_spec_accept_length_count"
    assert after[count] - before.get(count, 0.0) == verifies
    assert after["blockspec_spec_verify_total"] - before.get("blockspec_spec_verify_total", 0.0) == verifies
    committed = sum(round(u.spec_accept_length * u.spec_verify_ct) for _, u in results)
    assert after["blockspec_spec_accept_length_sum"] - before.get("blockspec_spec_accept_length_sum", 0.0) \
        == pytest.approx(committed)
    first = after['blockspec_spec_accepted_tokens_per_pos_total{position="1"}']
    last = after[f'blockspec_spec_accepted_tokens_per_pos_total{{position="{BLOCK - 1}"}}']
    assert verifies > first > 0 and first >= last > 0    # drafts accepted at every position, less often deeper
    short = after['blockspec_spec_accept_length_bucket{le="1.0"}']
    assert 0 < short < verifies                             # and rejected outright at times
    # fixed width: every verify ran at the maximum width
    widths = "blockspec_spec_verify_width_count"
    assert after[widths] - before.get(widths, 0.0) == verifies
    assert after[f'blockspec_spec_verify_width_bucket{{le="{BLOCK - 1}.0"}}'] == 0
