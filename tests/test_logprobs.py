"""Log-probabilities: prompt logprobs equal a full-sequence log_softmax of the target (across
prefill chunks, from any start, with max_new_tokens 0), top alternatives are sorted and agree
with the chosen token, and speculation returns the target's numbers at each committed position."""
from __future__ import annotations

import queue

import pytest
import torch

from blockspec import Engine
from blockspec.engine.engine import GenerateError
from blockspec.sampling import SamplingParams
from tests.test_penalties import _engine, target  # noqa: F401 - the module's fixture

PROMPT = [3, 8, 13, 5, 5, 21, 1, 17, 9, 4, 11]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _direct(e: Engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of the target at every position of ``ids`` in one forward."""
    return torch.log_softmax(e.runner.score([ids])[0].float(), dim=-1)


@pytest.mark.parametrize("chunk", [3, 4096])
def test_prompt_logprobs_match_a_full_forward(target, chunk):  # noqa: F811
    e = _engine(*target, "NONE", chunked_prefill_size=chunk)
    try:
        out = e.generate(input_ids=[PROMPT, PROMPT[:1], PROMPT[:6]],
                         sampling_params={**GREEDY, "max_new_tokens": 0},
                         logprob_start_len=0, top_logprobs_num=4)
        lsm = _direct(e, PROMPT)
        for o, n in zip(out, (len(PROMPT), 1, 6)):
            meta = o["meta_info"]
            assert o["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
            lps, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
            assert [t for _, t in lps] == PROMPT[:n] and len(tops) == n
            assert lps[0][0] is None and tops[0] == []
            for i in range(1, n):
                assert abs(lps[i][0] - float(lsm[i - 1, PROMPT[i]])) < 1e-4
                ref_v, ref_i = lsm[i - 1].topk(4)
                assert [t for _, t in tops[i]] == ref_i.tolist()
                assert [v for v, _ in tops[i]] == sorted((v for v, _ in tops[i]), reverse=True)
                assert max(abs(a - b) for (a, _), b in zip(tops[i], ref_v.tolist())) < 1e-4
    finally:
        e.shutdown()


def test_prompt_logprobs_from_a_start_position(target):  # noqa: F811
    e = _engine(*target, "NONE", chunked_prefill_size=4)
    try:
        o = e.generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 1},
                       logprob_start_len=5)
        lps = o["meta_info"]["input_token_logprobs"]
        lsm = _direct(e, PROMPT)
        assert [t for _, t in lps] == PROMPT[5:]
        assert all(abs(lp - float(lsm[5 + j - 1, t])) < 1e-4 for j, (lp, t) in enumerate(lps))
        assert o["meta_info"]["input_top_logprobs"] == [[] for _ in lps]
    finally:
        e.shutdown()


def test_streamed_prompt_logprobs_come_once_with_the_first_output(target):  # noqa: F811
    e = _engine(*target, "NONE")
    try:
        outs: queue.SimpleQueue = queue.SimpleQueue()
        e.submit(PROMPT, SamplingParams(**GREEDY), outs.put, stream=True, logprob_start_len=0,
                 top_logprobs_num=2)
        got = []
        while not got or not got[-1].finished:
            got.append(outs.get(timeout=30))
        with_prompt = [g for g in got if g.prompt_logprobs is not None]
        assert len(with_prompt) == 1 and with_prompt[0] is got[0]
        assert len(got[0].prompt_logprobs) == len(PROMPT)
        assert sum(len(g.top_logprobs) for g in got) == GREEDY["max_new_tokens"]
        assert all(len(t) == 2 for g in got for t in g.top_logprobs)
    finally:
        e.shutdown()


@pytest.mark.parametrize("algo", ["NONE", "DFLASH", "DSPARK"])
def test_top_logprobs_are_the_targets_and_agree_with_the_chosen_token(target, algo):  # noqa: F811
    e = _engine(*target, algo)
    try:
        params = [GREEDY, {**GREEDY, "temperature": 1.0, "seed": 3}]
        outs = e.generate(input_ids=[PROMPT[:4], PROMPT[:4]], sampling_params=params,
                          return_logprob=True, top_logprobs_num=5)
        for o in outs:
            meta = o["meta_info"]
            chosen, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
            assert len(tops) == len(chosen) == len(o["output_ids"])
            lsm = _direct(e, PROMPT[:4] + o["output_ids"])
            for j, ((lp, tok), top) in enumerate(zip(chosen, tops)):
                vals = [v for v, _ in top]
                assert len(top) == 5 and vals == sorted(vals, reverse=True)
                if tok in [t for _, t in top]:
                    assert {t: v for v, t in top}[tok] == lp     # the same number
                else:
                    assert lp <= vals[-1]
                ref_v, ref_i = lsm[3 + j].topk(5)
                assert [t for _, t in top] == ref_i.tolist()
                assert max(abs(a - b) for a, b in zip(vals, ref_v.tolist())) < 1e-4
        assert outs[0]["output_ids"][0] == outs[0]["meta_info"]["output_top_logprobs"][0][0][1]
    finally:
        e.shutdown()


@pytest.mark.parametrize("kw, param", [({"top_logprobs_num": 21}, "top_logprobs_num"),
                                       ({"top_logprobs_num": -1}, "top_logprobs_num"),
                                       ({"logprob_start_len": -2}, "logprob_start_len")])
def test_bad_logprob_arguments_name_the_argument(target, kw, param):  # noqa: F811
    e = _engine(*target, "NONE")
    try:
        with pytest.raises(GenerateError) as err:
            e.generate(input_ids=PROMPT, sampling_params=GREEDY, **kw)
        assert err.value.param == param
    finally:
        e.shutdown()
