"""Admission shares the engine between client requests: a request of many prompts is admitted
a share at a time, round-robin with the others, so a small request beside it gets its first
token within a few steps; one request may ask for at most --max-prompts-per-request sequences."""
from __future__ import annotations

import threading

import pytest

from blockspec import Engine
from blockspec.sampling import SamplingParams

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from blockspec.server.launch import ServerThread  # noqa: E402
from tests.polling import wait_until  # noqa: E402

SP = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}


def test_a_small_request_beside_a_huge_one_starts_within_a_few_steps(tiny_folder):
    e = Engine(model_path=str(tiny_folder), device="cpu", max_running_requests=8)
    try:
        prompts = [[3 + i % 200, 4, 5] for i in range(200)]
        want_big = e.generate(input_ids=prompts[:3], sampling_params=SP)
        want_small = e.generate(input_ids=[9, 8, 7], sampling_params=SP)["output_ids"]
        outs: dict[str, list] = {}
        lock = threading.Lock()

        def sink(rid):
            outs[rid] = []

            def put(out):
                with lock:
                    outs[rid].append((e.stats().steps, out))
            return put

        params = SamplingParams.from_dict(SP)
        with e._loop.grouped():                        # one client request of 200 prompts
            for i, ids in enumerate(prompts):
                e.submit(ids, params, sink(f"big{i}"), rid=f"big{i}", group="big")
        wait_until(lambda: e.stats().running == 8 and e.stats().steps >= 5)
        submitted_at = e.stats().steps
        e.submit([9, 8, 7], params, sink("small"), rid="small", group="small")
        wait_until(lambda: bool(outs["small"]) and outs["small"][-1][1].finished)
        first = next(step for step, o in outs["small"] if o.token_ids)
        assert first - submitted_at <= 4, (submitted_at, first)
        assert [t for _, o in outs["small"] for t in o.token_ids] == want_small
        wait_until(lambda: all(outs[f"big{i}"] and outs[f"big{i}"][-1][1].finished
                          for i in range(200)), timeout=300)
        for i in range(3):        # the big request lost nothing to the one that cut in
            got = [t for _, o in outs[f"big{i}"] for t in o.token_ids]
            assert got == want_big[i]["output_ids"], i
        assert e.stats().cache_usage == 0.0
    finally:
        e.shutdown()


def test_round_robin_between_groups_in_the_queue(tiny_folder):
    from blockspec.engine.request import Request
    from blockspec.engine.fair_queue import FairQueue

    q = FairQueue()
    reqs = [Request(rid=f"a{i}", prompt_ids=[1], params=SamplingParams(), group="a")
            for i in range(3)]
    reqs += [Request(rid="b0", prompt_ids=[1], params=SamplingParams(), group="b"),
             Request(rid="c0", prompt_ids=[1], params=SamplingParams())]
    for r in reqs:
        q.append(r)
    assert len(q) == 5 and reqs[3] in q
    assert [q.popleft().rid for _ in range(5)] == ["a0", "b0", "c0", "a1", "a2"]


def test_server_caps_prompts_per_request_and_serves_a_small_one_beside_a_big_one(tiny_folder):
    e = Engine(model_path=str(tiny_folder), device="cpu", max_running_requests=8)
    server = ServerThread(e, max_prompts_per_request=64)
    try:
        url = server.url
        too_many = httpx.post(url + "/v1/completions", timeout=60,
                              json={"prompt": [[1, 2]] * 65, "max_tokens": 2})
        assert too_many.status_code == 400, too_many.text
        err = too_many.json()["error"]
        assert err["param"] == "prompt" and err["code"] == "too_many_prompts"
        assert "65" in err["message"] and "64" in err["message"]
        n_over = httpx.post(url + "/v1/completions", timeout=60,
                            json={"prompt": [[1, 2]] * 33, "n": 2, "max_tokens": 2})
        assert n_over.status_code == 400 and n_over.json()["error"]["param"] == "n"
        chat_n = httpx.post(url + "/generate", timeout=60,
                            json={"input_ids": [[1, 2]] * 65})
        assert chat_n.status_code == 400 and chat_n.json()["error"]["param"] == "input_ids"

        big: dict = {}

        def run_big():
            r = httpx.post(url + "/v1/completions", timeout=300,
                           json={"prompt": [[3 + i, 4] for i in range(64)], "max_tokens": 40,
                                 "temperature": 0, "ignore_eos": True})
            big["status"] = r.status_code
        t = threading.Thread(target=run_big)
        t.start()
        wait_until(lambda: e.stats().running == 8 and e.stats().steps >= 5)
        # the engine's own count: steps from the small request's submission to its first
        # output (a sink sees stats at least as fresh as its output), so the HTTP path's
        # latency on a loaded machine does not count
        waited: list[int] = []
        submit = e.submit

        def spy(ids, params, sink, **kw):
            if list(ids) != [7, 8]:
                return submit(ids, params, sink, **kw)
            start = e.stats().steps

            def first(out):
                if not waited:
                    waited.append(e.stats().steps - start)
                sink(out)
            return submit(ids, params, first, **kw)

        e.submit = spy
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={   # a chunk a token
                "prompt": [7, 8], "max_tokens": 20, "stream": True, "temperature": 0,
                "logprobs": 0, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            rest = [line for line in lines if line.startswith("data: ")]
        # without sharing it would wait for 64 prompts x 40 tokens, 8 at a time (~320 steps)
        assert '"finish_reason":null' in first and waited and waited[0] <= 6, waited
        assert rest[-1] == "data: [DONE]"
        t.join(300)
        assert big["status"] == 200
    finally:
        server.stop()
        e.shutdown()
