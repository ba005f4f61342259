"""The prefix cache end to end: with it on, every answer is token for token the answer with it
off (AR, DFlash, DSpark; greedy and seeded sampling), for hits exactly at a Mamba checkpoint,
between checkpoints (rounded down), at a prompt's end, across prefill chunks, after an
eviction, and on the next turn of a conversation (the hit covers the previous answer). Seeded
speculative sampling depends on the drafts, so equal outputs also say the draft context the
shared pages carry is right. A stress run keeps tiny pools evicting and ends consistent."""
from __future__ import annotations

import random

import pytest

from blockspec import Engine
from tests.spec_fixtures import low_entropy_target_and_drafts

PAGE, INTERVAL, CHUNK = 4, 16, 12
KW = {"device": "cpu", "page_size": PAGE, "mamba_track_interval": INTERVAL,
      "chunked_prefill_size": CHUNK}
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 8, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """The low-entropy speculative target and one DFlash and one DSpark draft."""
    return low_entropy_target_and_drafts(tmp_path_factory.mktemp("prefix_spec"))


def _pair(folder, algo=None, draft=None, **kw):
    extra = ({"speculative_algorithm": algo, "speculative_draft_model_path": str(draft)}
             if algo else {})
    off = Engine(model_path=str(folder), disable_radix_cache=True, **KW, **extra, **kw)
    on = Engine(model_path=str(folder), enable_radix_cache=True, **KW, **extra, **kw)
    return off, on


def _same(off, on, prompt, params):
    """Both engines' answers to ``prompt``: equal ids (and acceptance); the cached one's."""
    a = off.generate(input_ids=prompt, sampling_params=params)
    b = on.generate(input_ids=prompt, sampling_params=params)
    assert b["output_ids"] == a["output_ids"], f"prompt of {len(prompt)} tokens"
    if "spec_accept_histogram" in a["meta_info"]:
        assert b["meta_info"]["spec_accept_histogram"] == a["meta_info"]["spec_accept_histogram"]
    assert a["meta_info"]["cached_tokens"] == 0
    return b


def _scenario(off, on, params, low, high):
    rng = random.Random(1)
    base = [rng.randrange(low, high) for _ in range(48)]

    def tok() -> int:
        return rng.randrange(low, high)
    # p0: checkpoints at 16 (interval) and 28 (its last page boundary); its answer is sealed
    # up to the last page boundary of what it committed (30 + 10 - 1 -> 36)
    r0 = _same(off, on, base[:30], params)
    assert r0["meta_info"]["cached_tokens"] == 0
    cases = [(base[:16] + [tok()], 16),          # exactly at a checkpoint
             (base[:22] + [tok(), tok()], 16),   # between checkpoints: rounds down
             (base[:30] + [tok()], 28),          # at p0's end
             (base[:30], 28),                    # p0 again: one token is always prefilled
             (base[:48], 28),                    # the rest prefilled over several chunks
             (base[:48], 44),                    # sent again (page aligned): 44 and 32 are
             (base[:40] + [tok()], 32)]          # checkpoints of that resumed prefill
    for prompt, cached in cases:
        assert _same(off, on, prompt, params)["meta_info"]["cached_tokens"] == cached
    turn = base[:30]
    out = r0["output_ids"]
    for _ in range(2):                          # turns 2 and 3 reuse the previous answers
        turn = turn + out + [tok()]
        committed = len(turn) - 1               # the previous turn's prompt + answer - 1 were cached
        r = _same(off, on, turn, params)
        prev_committed = committed - 1
        assert r["meta_info"]["cached_tokens"] == prev_committed // PAGE * PAGE
        assert r["meta_info"]["cached_tokens"] > len(turn) - len(out) - 2 - PAGE
        out = r["output_ids"]
    on.memory.prefix.audit([])


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_ar_cached_answers_are_the_uncached_ones(tiny_folder, params):
    off, on = _pair(tiny_folder)
    with off, on:
        _scenario(off, on, params, 3, 259)


@pytest.mark.parametrize("algo", ["DFLASH", "DSPARK"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculative_cached_answers_are_the_uncached_ones(spec, algo, params):
    folder, drafts = spec
    off, on = _pair(folder, algo, drafts[algo])
    with off, on:
        _scenario(off, on, params, 0, 23)


EVICTING = {"max_total_tokens": 96, "mamba_cache_slots": 2, "max_running_requests": 2}


def _evicted(off, on):
    """A cached prefix pushed out by unrelated prompts is computed again, then hit again."""
    rng = random.Random(2)
    base = [rng.randrange(3, 259) for _ in range(30)]
    _same(off, on, base, GREEDY)
    assert _same(off, on, base + [9], GREEDY)["meta_info"]["cached_tokens"] == 28
    for _ in range(3):                      # unrelated prompts take the pages and snapshots
        _same(off, on, [rng.randrange(3, 259) for _ in range(30)], GREEDY)
    assert _same(off, on, base + [9], GREEDY)["meta_info"]["cached_tokens"] == 0
    assert _same(off, on, base + [10], GREEDY)["meta_info"]["cached_tokens"] == 28
    on.memory.prefix.audit([])


def test_evicted_prefix_is_computed_again_and_cached_again(tiny_folder):
    off, on = _pair(tiny_folder, **EVICTING)
    with off, on:
        _evicted(off, on)


def test_shared_prefix_checkpoint_outlives_its_first_requests_later_ones(tiny_folder):
    """One request at a time with the default snapshot slots: the first request saves the
    shared prefix's checkpoints, then its suffix's, its prompt end's and its answer's; the
    prefix's must survive them, so every later request with another suffix resumes there."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 259) for _ in range(64)]
    with Engine(model_path=str(tiny_folder), enable_radix_cache=True, max_running_requests=1,
                **KW) as engine:
        got = [engine.generate(input_ids=prefix + [rng.randrange(3, 259) for _ in range(22)],
                               sampling_params=GREEDY)["meta_info"]["cached_tokens"]
               for _ in range(3)]
    assert got == [0, 64, 64]


def test_prompt_logprobs_bypass_the_lookup(tiny_folder):
    off, on = _pair(tiny_folder)
    prompt = list(range(3, 40))
    with off, on:
        on.generate(input_ids=prompt, sampling_params=GREEDY)
        kw = {"input_ids": prompt, "sampling_params": GREEDY, "logprob_start_len": 0}
        a, b = off.generate(**kw), on.generate(**kw)
        assert b["meta_info"]["cached_tokens"] == 0
        want, got = a["meta_info"]["input_token_logprobs"], b["meta_info"]["input_token_logprobs"]
        assert len(got) == len(prompt) and got[0][0] is None       # every prompt row computed
        assert [g[1] for g in got] == [w[1] for w in want]
        assert [g[0] for g in got[1:]] == pytest.approx([w[0] for w in want[1:]], abs=1e-5)
        assert on.generate(input_ids=prompt + [5], sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 36


@pytest.mark.parametrize("algo, batches", [(None, 40), ("DFLASH", 10)])
def test_stress_tiny_pools_stay_consistent_and_exact(tiny_folder, spec, algo, batches):
    """Batches of 25 requests (1000 for AR, 250 for DFlash) sharing random prefixes (and some
    continuing an earlier conversation) on pools so small that pages and snapshots are
    evicted all the time; compared with an uncached engine with room for everything."""
    folder, vocab = (tiny_folder, 259) if algo is None else (spec[0], 23)
    extra = {} if algo is None else {"speculative_algorithm": algo,
                                     "speculative_draft_model_path": str(spec[1][algo])}
    on = Engine(model_path=str(folder), enable_radix_cache=True, **{**KW, "chunked_prefill_size": 32},
                max_total_tokens=160, mamba_cache_slots=3, max_running_requests=4, **extra)
    off = Engine(model_path=str(folder), disable_radix_cache=True, device="cpu",
                 max_running_requests=32, **extra)
    drops = []
    real_drop = on.memory.prefix._drop
    on.memory.prefix._drop = lambda node: (drops.append(node), real_drop(node))
    rng = random.Random(3)
    roots = [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(6)]
    history: list[list[int]] = []
    hits = 0
    with off, on:
        for b in range(batches):
            params = ({"max_new_tokens": 3, "temperature": 0, "ignore_eos": True} if b % 2 else
                      {"max_new_tokens": 3, "temperature": 1.0, "seed": b, "ignore_eos": True})
            prompts = []
            for _ in range(25):
                if history and rng.random() < 0.3:
                    prompt = rng.choice(history) + [rng.randrange(3, vocab)]
                else:
                    prompt = rng.choice(roots)[:rng.randrange(0, 25)]
                    prompt = prompt + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))]
                prompts.append(prompt[-40:])
            want = off.generate(input_ids=prompts, sampling_params=params)
            got = on.generate(input_ids=prompts, sampling_params=params)
            assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
            hits += sum(g["meta_info"]["cached_tokens"] for g in got)
            history += [p + g["output_ids"] for p, g in zip(prompts, got) if len(p) < 36]
            on.memory.prefix.audit([])          # between calls nothing is running
        m = on.memory
        m.prefix.audit([])
        assert len(m._free_slots) == 4 and on.stats().cache_usage == 0.0
        assert hits > 0 and m.prefix.hit_tokens == hits and len(drops) > 10 * batches


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.fixture(scope="module")
def cached_server(tiny_folder):
    pytest.importorskip("fastapi")
    from blockspec.server.launch import ServerThread  # lazy: fastapi may be missing

    engine = Engine(model_path=str(tiny_folder), device="cpu", enable_radix_cache=True)
    server = ServerThread(engine, served_model_name="tiny")
    yield server
    server.stop()
    engine.shutdown()


def test_cache_is_off_by_default(tiny_server):
    httpx = pytest.importorskip("httpx")
    server, engine = tiny_server
    assert engine.memory.prefix is None
    body = {"model": "tiny", "prompt": "x" * 40, "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(2):
            usage = http.post("/v1/completions", json=body).json()["usage"]
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_cached_tokens_reported_in_usage_meta_info_and_metrics(cached_server):
    """A server with the cache on (16-token pages): a prompt sent again reports its cached
    tokens in OpenAI usage (plain and streamed, completions and chat), in /generate's
    meta_info, and in the Prometheus counters."""
    httpx = pytest.importorskip("httpx")
    server = cached_server
    text = "".join(random.Random(4).choice("abcdefghij") for _ in range(40))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = _metric(http.get("/metrics").text, "blockspec_prefix_cache_hit_tokens_total")
        body = {"model": "tiny", "prompt": text, "max_tokens": 3, "temperature": 0}
        first = http.post("/v1/completions", json=body).json()["usage"]
        again = http.post("/v1/completions", json=body).json()["usage"]
        n = again["prompt_tokens"]
        want = (n - 1) // 16 * 16
        assert want >= 32 and again["prompt_tokens_details"]["cached_tokens"] == want
        assert first["prompt_tokens_details"]["cached_tokens"] <= want
        with http.stream("POST", "/v1/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
        assert f'"cached_tokens":{want}' in lines[-1]
        gen = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2}})
        assert gen.json()["meta_info"]["cached_tokens"] == want
        chat = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        http.post("/v1/chat/completions", json=chat)
        usage = http.post("/v1/chat/completions", json=chat).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 16 * 16
        metrics = http.get("/metrics").text
        assert _metric(metrics, "blockspec_prefix_cache_hit_tokens_total") >= before + 3 * want
        assert _metric(metrics, "blockspec_prefix_cache_queried_tokens_total") >= 4 * n
        assert _metric(metrics, "blockspec_prefix_cache_pages") > 0


def test_requests_rolled_back_after_a_failed_step_drop_their_shared_pages(tiny_folder):
    """Innocents resumed from a cached prefix share its pages when a decode step fails mid
    forward (their Mamba state has moved on): they are rolled back onto fresh pages, computed
    again from zero, and end with the tokens of an uncached run; the cache stays consistent."""
    from blockspec.engine.request import Request  # lazy: only this test builds one by hand
    from blockspec.forward_metadata import Mode  # lazy: only this test injects a failure
    from blockspec.sampling import SamplingParams  # lazy: as above
    from tests.polling import wait_until  # lazy: as above
    from tests.test_fault_isolation import Collect  # lazy: as above

    rng = random.Random(5)
    base = [rng.randrange(3, 259) for _ in range(20)]
    prompts = [base + [3 + i] for i in range(3)]
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    off, on = _pair(tiny_folder)
    with off, on:
        want = [o["output_ids"] for o in off.generate(input_ids=prompts, sampling_params=params)]
        on.generate(input_ids=base, sampling_params=GREEDY)          # caches base[:16]
        culprit = Request(rid="bad", prompt_ids=[11, 12, 13], params=SamplingParams(
            max_new_tokens=30, temperature=0.0, ignore_eos=True))
        real = type(on.model)._mamba

        def failing(mixer, n, x, meta):
            out = real(mixer, n, x, meta)
            slot = culprit.cache.slot
            if meta.mode == Mode.DECODE and slot >= 0:
                rows = (meta.req_slots == slot).nonzero().flatten().tolist()
                if rows and int(meta.positions[rows[0]]) == 7:
                    raise RuntimeError("injected failure")
            return out

        on.model._mamba = failing
        c = Collect()
        rids = [on.submit(p, SamplingParams.from_dict(params), c.sink(f"ok{i}"), rid=f"ok{i}")
                for i, p in enumerate(prompts)]
        wait_until(lambda: all(len(c.ids(r)) >= 3 for r in rids))
        on._loop.submit(culprit, c.sink("bad"))
        wait_until(lambda: all(c.done(r) for r in rids + ["bad"]))
        assert c.reason("bad")["type"] == "error"
        assert [c.outs[r][-1].meta_info["cached_tokens"] for r in rids] == [16, 16, 16]
        assert [c.ids(r) for r in rids] == want
        on.memory.prefix.audit([])
        assert on.stats().cache_usage == 0.0


def test_preempted_requests_resume_from_their_own_checkpoints(tiny_folder):
    """A small client request cuts in: the big one's latest admitted request is preempted,
    releases its pages and, admitted again, resumes from the checkpoints it left; every output
    is the uncached one and the pools end consistent."""
    from blockspec.sampling import SamplingParams  # lazy: only this test submits by hand
    from tests.polling import wait_until  # lazy: as above
    from tests.test_fault_isolation import Collect  # lazy: as above

    rng = random.Random(6)
    base = [rng.randrange(3, 259) for _ in range(24)]
    big = [base + [rng.randrange(3, 259) for _ in range(6)] for _ in range(4)]
    small = [rng.randrange(3, 259) for _ in range(10)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    off, on = _pair(tiny_folder, max_running_requests=2, mamba_cache_slots=16)
    with off, on:
        want = [o["output_ids"] for o in off.generate(input_ids=big + [small], sampling_params=params)]
        preempted = []
        real = on.scheduler._preempt_for

        def counting_preempt(req):
            done = real(req)
            if done:
                preempted.append(req.rid)
            return done

        on.scheduler._preempt_for = counting_preempt
        resumed = []                                 # admissions after a preemption: hits
        admit = on.memory.admit

        def counting_admit(need, hit=None):
            res = admit(need, hit)
            if preempted:
                resumed.append(res.cached)
            return res

        on.memory.admit = counting_admit
        c = Collect()
        sp = SamplingParams.from_dict(params)
        with on._loop.grouped():
            for i, ids in enumerate(big):
                on.submit(ids, sp, c.sink(f"big{i}"), rid=f"big{i}", group="big")
        wait_until(lambda: on.stats().running == 2 and all(len(c.ids(f"big{i}")) >= 4 for i in range(2)))
        on.submit(small, sp, c.sink("small"), rid="small", group="small")
        rids = [f"big{i}" for i in range(4)] + ["small"]
        wait_until(lambda: all(c.done(r) for r in rids), timeout=120)
        assert preempted == ["small"]
        assert [c.ids(r) for r in rids] == want
        on.memory.prefix.audit([])
        assert max(resumed) >= 28                  # the victim's own prompt-end checkpoint


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", [None, "dflash", "dspark"])
def test_gpu_cached_answers_are_the_uncached_ones(tiny_folder, kind):
    """The same scenarios on CUDA (Triton kernels, CUDA graphs), fp32: every hit kind, then
    an eviction."""
    import torch  # lazy: only the GPU test needs it here

    from blockspec.bench.draft_presets import build_random_draft  # lazy: GPU test only
    from blockspec.bench.presets import preset_config  # lazy: GPU test only

    target = Engine(model_path=str(tiny_folder), device="cuda", dtype="float32",
                    disable_radix_cache=True)
    draft = (build_random_draft(kind, preset_config("tiny"), 4, torch.device("cuda"), torch.float32)
             if kind else None)
    kw = {k: v for k, v in KW.items() if k != "device"}
    with target:
        for params in (GREEDY, SEEDED):
            off = Engine.from_model(target.model, draft=draft, **kw)
            on = Engine.from_model(target.model, draft=draft, enable_radix_cache=True, **kw)
            with off, on:
                _scenario(off, on, params, 3, 259)
        off = Engine.from_model(target.model, draft=draft, **kw, **EVICTING)
        on = Engine.from_model(target.model, draft=draft, enable_radix_cache=True, **kw, **EVICTING)
        with off, on:
            _evicted(off, on)
