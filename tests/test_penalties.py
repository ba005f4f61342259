"""Penalties, logit_bias and min_new_tokens: the device function against a per-token reference,
the fields' validation, and losslessness under speculation (greedy token for token across NONE,
DFLASH and DSPARK; seeded sampling by chi-square against the exact penalised target law)."""
from __future__ import annotations

import pytest
import torch

from blockspec import Engine
from blockspec.engine.engine import GenerateError
from blockspec.forward_metadata import Mode
from blockspec.penalties import PenaltyState, count_tokens, penalize
from blockspec.sampling import SamplingParams, SamplingParamsError, params_to_tensors, target_probs
from tests.spec_fixtures import (
    draft_config,
    make_spec_target,
    pairs_chi_square_pvalue,
    write_draft,
)
from tests.test_dflash import HIDDEN, LAYERS, VOCAB

PROMPTS = [[(3 + 5 * i) % 23, (5 + 3 * i) % 23, 7 + i % 3, 11, 2 + i][: 2 + i % 4] for i in range(8)]
EOS = 2
PENALISED = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "presence_penalty": 0.5,
             "frequency_penalty": 0.3, "repetition_penalty": 1.3, "logit_bias": {3: 2.0, 5: -1.0},
             "min_new_tokens": 6, "stop_token_ids": [9]}


def reference(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams,
              banned: set[int]) -> torch.Tensor:
    """The penalties one token at a time, in plain Python over a [V] fp32 row."""
    x = logits.float().clone()
    bias = {int(k): b for k, b in (p.logit_bias or {}).items()}
    for t in range(x.shape[0]):
        v = x[t] + float(bias.get(t, 0.0))
        c = out.count(t)
        if t in prompt or c:
            v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        v = v - p.presence_penalty * (c > 0)
        v = v - p.frequency_penalty * c
        if len(out) < p.min_new_tokens and t in banned:
            v = torch.tensor(float("-inf"))
        x[t] = v
    return x


def _state(rows: list[tuple[list[int], list[int], SamplingParams]], vocab: int, banned: list[int]):
    st = PenaltyState(len(rows) + 1, vocab, torch.device("cpu"))
    for slot, (prompt, out, p) in enumerate(rows):
        st.fill(slot, prompt, out, p, banned)
    inp = {"slot": torch.arange(len(rows)),
           "sample_ctr": torch.tensor([len(o) for _, o, _ in rows]), **st.views()}
    return st, inp


def test_penalize_matches_per_token_reference():
    g = torch.Generator().manual_seed(0)
    V = 40
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.5),
              SamplingParams(repetition_penalty=0.6, logit_bias={1: 100.0, "7": -3.5}),
              SamplingParams(min_new_tokens=4, frequency_penalty=2.0, stop_token_ids=[11]),
              SamplingParams()]
    rows = [([1, 2, 3, 3], [4, 4, 5, 1], params[0]), ([9, 8], [8, 8, 8], params[1]),
            ([0], [6, 6], params[2]), ([5], [5, 5], params[3])]
    banned = [2, 11]
    _, inp = _state(rows, V, banned)
    logits = torch.randn(len(rows), V, generator=g) * 3
    got = penalize(logits, inp)
    for b, (prompt, out, p) in enumerate(rows):
        torch.testing.assert_close(got[b], reference(logits[b], prompt, out, p, set(banned)),
                                   rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], logits[3])                  # no penalty: bit for bit the same
    assert got[2, 11] == float("-inf") and got[2, 2] == float("-inf")


def test_verify_rows_count_the_drafts_before_them():
    """Row j of a verify block is penalised as if drafts 0..j-1 were already output."""
    g = torch.Generator().manual_seed(1)
    V, T = 16, 4
    p = SamplingParams(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.2,
                       min_new_tokens=3, logit_bias={4: 1.5})
    prompt, out = [1, 2], [3, 3]
    drafts = torch.tensor([[3, 2, 7]])
    _, inp = _state([(prompt, out, p)], V, [0, 7])
    logits = torch.randn(1, T, V, generator=g)
    got = penalize(logits, inp, drafts)
    for j in range(T):
        so_far = out + drafts[0, :j].tolist()
        torch.testing.assert_close(got[0, j], reference(logits[0, j], prompt, so_far, p, {0, 7}),
                                   rtol=1e-6, atol=1e-6)


def test_count_tokens_adds_only_committed_tokens():
    counts = torch.zeros(3, 10, dtype=torch.int32)
    count_tokens(counts, torch.tensor([0, 2]), torch.tensor([[1, 1, 4], [5, 6, 7]]),
                 torch.tensor([[True, True, False], [True, False, False]]))
    count_tokens(counts, torch.tensor([0, 2]), torch.tensor([3, 5]))
    assert counts[0].tolist() == [0, 2, 0, 1, 0, 0, 0, 0, 0, 0]
    assert counts[2].tolist() == [0, 0, 0, 0, 0, 2, 0, 0, 0, 0]
    assert counts[1].sum() == 0


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", 2.5), ("logit_bias", {1: 101.0}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", [1]),
    ("min_new_tokens", -1), ("min_new_tokens", 1.5)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_dict({field: value})
    assert e.value.param == field and field in str(e.value)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("penalties")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    return root, folder


def _engine(root, folder, algo: str, **kw) -> Engine:
    if algo == "NONE":
        return Engine(model_path=str(folder), device="cpu", **kw)
    kind = algo.lower()
    cfg = draft_config(kind, hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS,
                       block_size=4 if kind == "dflash" else 3,
                       **({"head_type": "gated"} if kind == "dspark" else {}))
    draft = write_draft(root / f"draft_{kind}", cfg, std=0.05)
    return Engine(model_path=str(folder), device="cpu", speculative_algorithm=algo,
                  speculative_draft_model_path=str(draft), **kw)


def test_logit_bias_token_outside_the_vocabulary_is_refused(target):
    e = _engine(*target, "NONE")
    try:
        with pytest.raises(GenerateError) as err:
            e.generate(input_ids=[1, 2], sampling_params={"logit_bias": {VOCAB: 1.0}})
        assert err.value.param == "logit_bias"
    finally:
        e.shutdown()


def _greedy_reference(e: Engine, prompt: list[int], p: SamplingParams) -> list[int]:
    """Target-only greedy decoding with the penalties applied by ``reference`` per step."""
    out: list[int] = []
    banned = {EOS, *(p.stop_token_ids or ())}
    while len(out) < p.max_new_tokens:
        logits = e.runner.score([prompt + out])[0][-1]
        tok = int(reference(logits, prompt, out, p, banned).argmax())
        out.append(tok)
        if tok in (p.stop_token_ids or ()):
            break
    return out


def test_greedy_with_penalties_is_token_exact_under_speculation(target):
    outs = {}
    for algo in ("NONE", "DFLASH", "DSPARK"):
        e = _engine(*target, algo)
        try:
            res = e.generate(input_ids=PROMPTS, sampling_params=PENALISED)
            outs[algo] = [o["output_ids"] for o in res]
            if algo == "NONE":
                plain = e.generate(input_ids=PROMPTS, sampling_params={
                    k: v for k, v in PENALISED.items() if k in ("max_new_tokens", "temperature",
                                                                "ignore_eos", "stop_token_ids")})
                assert [o["output_ids"] for o in plain] != outs[algo]    # the penalties bite
                p = SamplingParams.from_dict(PENALISED)
                assert outs[algo][:3] == [_greedy_reference(e, pr, p) for pr in PROMPTS[:3]]
                assert all(EOS not in o[:6] and 9 not in o[:6] for o in outs[algo])
            else:
                hist = [sum(c) for c in zip(*[o["meta_info"]["spec_accept_histogram"] for o in res])]
                assert sum(hist[1:]) > 0, hist                  # drafts were accepted
        finally:
            e.shutdown()
    assert outs["DFLASH"] == outs["NONE"]
    assert outs["DSPARK"] == outs["NONE"]


def test_penalised_and_plain_requests_share_a_batch(target):
    """A plain request keeps its output beside penalised ones (and in a slot one of them used)."""
    e = _engine(*target, "DFLASH", max_running_requests=4)
    try:
        plain = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        alone = e.generate(input_ids=PROMPTS[:4], sampling_params=plain)
        mixed = e.generate(input_ids=PROMPTS[:4] * 2,
                           sampling_params=[PENALISED] * 4 + [plain] * 4)
        assert [o["output_ids"] for o in mixed[4:]] == [o["output_ids"] for o in alone]
    finally:
        e.shutdown()


def _exact_penalised_joint(e: Engine, prompt: list[int], params: dict) -> dict:
    """p(t1, t2) of target-only sampling with the penalties applied by ``reference``."""
    p = SamplingParams.from_dict(params)
    tens = params_to_tensors([p], torch.device("cpu"))
    banned = {EOS}
    p1 = target_probs(reference(e.runner.score([prompt])[0][-1], prompt, [], p, banned)[None],
                      *tens)[0]
    joint = {}
    for t in p1.nonzero().flatten().tolist():
        x = reference(e.runner.score([prompt + [t]])[0][-1], prompt, [t], p, banned)
        p2 = target_probs(x[None], *tens)[0]
        for u in p2.nonzero().flatten().tolist():
            joint[(t, u)] = float(p1[t] * p2[u])
    return joint


@pytest.mark.parametrize("algo", ["DFLASH", "DSPARK"])
def test_seeded_sampling_follows_the_penalised_law_under_speculation(target, algo):
    params = {"max_new_tokens": 2, "temperature": 1.0, "ignore_eos": True, "frequency_penalty": 1.5,
              "presence_penalty": 0.5, "repetition_penalty": 1.4, "logit_bias": {11: 1.0}}
    prompt, n = [7, 5], 4000
    e = _engine(*target, algo, max_running_requests=1000, max_total_tokens=1000 * 12)
    try:
        outs = e.generate(input_ids=[prompt] * n, sampling_params=params)
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) == n
        joint = _exact_penalised_joint(e, prompt, params)
    finally:
        e.shutdown()
    assert pairs_chi_square_pvalue(outs, joint) > 0.01
    # the penalties moved the law: the plain target's favourite pair is much rarer
    assert sum(o["output_ids"] == [5, 5] for o in outs) < 0.5 * n


@pytest.mark.parametrize("algo", ["NONE", "DFLASH"])
def test_penalised_requests_computed_again_after_a_failed_step_lose_nothing(target, algo):
    """A step fails once, mid-forward, after the state has moved on: the requests are rolled
    back, their penalty rows filled again from their committed tokens, and they end exactly as
    in a clean run."""
    e = _engine(*target, algo)
    try:
        clean = [o["output_ids"] for o in e.generate(input_ids=PROMPTS[:3], sampling_params=PENALISED)]
        real = type(e.model)._mamba
        fired = {"n": 0}

        def failing(mixer, n, x, meta):
            out = real(mixer, n, x, meta)
            if meta.mode in (Mode.DECODE, Mode.VERIFY) and fired["n"] == 0 \
                    and int(meta.positions.max()) >= 12:
                fired["n"] += 1
                raise RuntimeError("injected failure")
            return out

        e.model._mamba = failing
        again = [o["output_ids"] for o in e.generate(input_ids=PROMPTS[:3], sampling_params=PENALISED)]
        assert fired["n"] == 1 and again == clean
    finally:
        e.shutdown()
