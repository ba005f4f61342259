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
from tests.spec_fixtures import draft_config, make_spec_target, write_draft

PAGE, INTERVAL, CHUNK = 4, 16, 12
KW = dict(device="cpu", page_size=PAGE, mamba_track_interval=INTERVAL, chunked_prefill_size=CHUNK)
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 8, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """The low-entropy speculative target and one DFlash and one DSpark draft."""
    root = tmp_path_factory.mktemp("prefix_spec")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    drafts = {}
    for kind in ("dflash", "dspark"):
        cfg = draft_config(kind, hidden=32, vocab=24, target_layers=7, block_size=4)
        drafts[kind.upper()] = write_draft(root / kind, cfg, std=0.05)
    return folder, drafts


def _pair(folder, algo=None, draft=None, **kw):
    extra = dict(speculative_algorithm=algo, speculative_draft_model_path=str(draft)) if algo else {}
    off = Engine(model_path=str(folder), disable_radix_cache=True, **KW, **extra, **kw)
    on = Engine(model_path=str(folder), **KW, **extra, **kw)
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
    tok = lambda: rng.randrange(low, high)      # noqa: E731
    # p0: checkpoints at 16 (interval) and 28 (its last page boundary); its answer is sealed
    # up to the last page boundary of what it committed (30 + 10 - 1 -> 36)
    r0 = _same(off, on, base[:30], params)
    assert r0["meta_info"]["cached_tokens"] == 0
    cases = [(base[:16] + [tok()], 16),          # exactly at a checkpoint
             (base[:22] + [tok(), tok()], 16),   # between checkpoints: rounds down
             (base[:30] + [tok()], 28),          # at p0's end
             (base[:30], 28),                    # p0 again: one token is always prefilled
             (base[:48], 28)]                    # the rest prefilled over several chunks
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


def test_evicted_prefix_is_computed_again_and_cached_again(tiny_folder):
    off, on = _pair(tiny_folder, max_total_tokens=96, mamba_cache_slots=2, max_running_requests=2)
    rng = random.Random(2)
    base = [rng.randrange(3, 259) for _ in range(30)]
    with off, on:
        _same(off, on, base, GREEDY)
        assert _same(off, on, base + [9], GREEDY)["meta_info"]["cached_tokens"] == 28
        for _ in range(3):                      # unrelated prompts take the pages and snapshots
            _same(off, on, [rng.randrange(3, 259) for _ in range(30)], GREEDY)
        assert _same(off, on, base + [9], GREEDY)["meta_info"]["cached_tokens"] == 0
        assert _same(off, on, base + [10], GREEDY)["meta_info"]["cached_tokens"] == 28
        on.memory.prefix.audit([])


def test_prompt_logprobs_bypass_the_lookup(tiny_folder):
    off, on = _pair(tiny_folder)
    prompt = list(range(3, 40))
    with off, on:
        on.generate(input_ids=prompt, sampling_params=GREEDY)
        kw = dict(input_ids=prompt, sampling_params=GREEDY, logprob_start_len=0)
        a, b = off.generate(**kw), on.generate(**kw)
        assert b["meta_info"]["cached_tokens"] == 0
        want, got = a["meta_info"]["input_token_logprobs"], b["meta_info"]["input_token_logprobs"]
        assert len(got) == len(prompt) and got[0][0] is None       # every prompt row computed
        assert [g[1] for g in got] == [w[1] for w in want]
        assert [g[0] for g in got[1:]] == pytest.approx([w[0] for w in want[1:]], abs=1e-5)
        assert on.generate(input_ids=prompt + [5], sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 36
