"""Sampling parameters, the target distribution and seeded sampling (CPU, fp32)."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from blockspec.sampling import (
    SamplingParams,
    SamplingParamsError,
    Stream,
    inverse_cdf_sample,
    logprobs_of,
    params_to_tensors,
    request_seed,
    sample,
    target_probs,
    uniforms,
)


def assert_distribution(counts: torch.Tensor, probs: torch.Tensor, min_p_value: float = 0.01) -> None:
    """Chi-square goodness of fit; cells of probability 0 must be empty, and cells with an
    expected count below 5 are pooled so the test's approximation holds."""
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    total = counts.sum()
    zero = probs == 0
    assert counts[zero].sum() == 0, f"sampled a zero-probability cell: {counts[zero]}"
    expected = probs[~zero] / probs[~zero].sum() * total
    observed = counts[~zero]
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    p_value = chisquare(observed.numpy(), expected.numpy()).pvalue
    assert p_value > min_p_value, f"chi-square p={p_value:.2e}\nobserved={observed}\nexpected={expected}"


def probs_tensors(params: list[SamplingParams]):
    return params_to_tensors(params, "cpu")


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": -1}, "max_new_tokens must be >= 0, got -1"),
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an int"),
    ({"max_new_tokens": True}, "max_new_tokens must be an int"),
    ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": None}, "top_p must be a number in (0, 1]"),
    ({"top_k": -2}, "top_k must be -1 (off) or >= 1, got -2"),
    ({"top_k": 0}, "top_k must be -1 (off) or >= 1, got 0"),
    ({"top_k": 2.0}, "top_k must be an int"),
    ({"min_p": 1.2}, "min_p must be in [0, 1], got 1.2"),
    ({"min_p": -0.5}, "min_p must be in [0, 1], got -0.5"),
    ({"stop": ""}, "stop strings must be non-empty"),
    ({"stop": ["a", ""]}, "stop[1] is ''"),
    ({"stop": ["a", 3]}, "stop[1] must be a string"),
    ({"stop": 3}, "stop must be a string, a list of strings or None"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids[1] must be an int >= 0, got -2"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of ints or None"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ({"seed": 1.0}, "seed must be an int or None"),
    ({"seed": -1}, "seed must be in [0, 2**64), got -1"),
])
def test_validate_names_field_and_expectation(kwargs, message):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs).validate()
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_top_k_zero_message_says_use_minus_one():
    with pytest.raises(SamplingParamsError, match="use -1"):
        SamplingParams(top_k=0).validate()


def test_valid_params_pass():
    SamplingParams().validate()
    SamplingParams(max_new_tokens=0, temperature=0, top_p=1, top_k=1, min_p=1.0,
                   stop=["\n\n", "END"], stop_token_ids=[0, 2], ignore_eos=True,
                   seed=2**64 - 1).validate()


def test_from_dict_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict({"temperature": 0.5, "top-p": 0.9})
    msg = str(info.value)
    assert "'top-p'" in msg
    for key in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                "stop_token_ids", "ignore_eos", "seed"):
        assert key in msg


def test_from_dict_builds_and_validates():
    assert SamplingParams.from_dict(None) == SamplingParams()
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": 20, "stop": "x", "seed": 7})
    assert (p.temperature, p.top_k, p.stop, p.seed) == (0.5, 20, "x", 7)
    with pytest.raises(SamplingParamsError, match="top_p must be in"):
        SamplingParams.from_dict({"top_p": 2.0})
    with pytest.raises(SamplingParamsError, match="must be a dict"):
        SamplingParams.from_dict([("temperature", 1.0)])


def test_is_greedy_and_stop_strings():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy
    assert SamplingParams().stop_strings() == []
    assert SamplingParams(stop="a").stop_strings() == ["a"]
    assert SamplingParams(stop=["a", "b"]).stop_strings() == ["a", "b"]


def test_params_to_tensors_encodes_greedy_as_zero_temperature():
    t, k, p, m = params_to_tensors(
        [SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=0.5, top_p=0.9, min_p=0.1)],
        "cpu")
    assert t.tolist() == [0.0, 0.5] and t.dtype == torch.float32
    assert k.tolist() == [1, -1] and k.dtype == torch.long
    assert p.tolist() == pytest.approx([1.0, 0.9]) and m.tolist() == pytest.approx([0.0, 0.1])


# ---------------------------------------------------------------- target_probs

BASE = torch.tensor([0.1, 0.4, 0.2, 0.3])


def filtered(**kw) -> torch.Tensor:
    params = SamplingParams(**kw)
    return target_probs(BASE.log()[None], *probs_tensors([params]))[0]


def test_greedy_is_one_hot_at_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 5.0]])
    t, k, p, m = probs_tensors([SamplingParams(temperature=0)] * 2)
    probs = target_probs(logits, t, k, p, m)
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    out = sample(logits, t, k, p, m, None, greedy_only=True)
    assert out.tolist() == [1, 0]


def test_plain_softmax_and_temperature():
    assert torch.equal(filtered(), torch.softmax(BASE.log(), -1))
    expected = BASE.sqrt() / BASE.sqrt().sum()  # softmax(log p / 2) is proportional to sqrt(p)
    torch.testing.assert_close(filtered(temperature=2.0), expected)


@pytest.mark.parametrize("kw, expected", [
    ({"top_k": 2}, [0, 4 / 7, 0, 3 / 7]),
    ({"top_k": 3}, [0, 4 / 9, 2 / 9, 3 / 9]),
    ({"top_k": 10}, [0.1, 0.4, 0.2, 0.3]),  # k >= V is off
    ({"top_p": 0.65}, [0, 4 / 7, 0, 3 / 7]),  # masses above: 0, .4, .7, .9
    ({"top_p": 0.75}, [0, 4 / 9, 2 / 9, 3 / 9]),
    ({"top_p": 0.3}, [0, 1, 0, 0]),  # the top token is always kept
    ({"min_p": 0.6}, [0, 4 / 7, 0, 3 / 7]),  # threshold .24
    ({"min_p": 0.45}, [0, 4 / 9, 2 / 9, 3 / 9]),  # threshold .18
    ({"min_p": 1.0}, [0, 1, 0, 0]),
    # top-p runs on the top-k distribution renormalised: top-3 = (.444, .333, .222), masses
    # above = (0, .444, .778) so top_p .75 keeps two (on the raw masses 0, .4, .7 it would keep 3).
    ({"top_k": 3, "top_p": 0.75}, [0, 4 / 7, 0, 3 / 7]),
    # min-p after top-k/top-p: threshold .6 * .4 = .24 drops the .2 that top-p .75 kept.
    ({"top_p": 0.75, "min_p": 0.6}, [0, 4 / 7, 0, 3 / 7]),
    ({"top_k": 3, "min_p": 0.45}, [0, 4 / 9, 2 / 9, 3 / 9]),
])
def test_filters_on_hand_made_distribution(kw, expected):
    torch.testing.assert_close(filtered(**kw), torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=1e-6)


def test_filters_with_temperature_apply_to_tempered_softmax():
    # T=2 -> probs proportional to sqrt(.1,.4,.2,.3) = (.316,.632,.447,.548)/1.943
    # = (.163,.325,.230,.282); masses above in order .325,.282,.230,.163: 0,.325,.607,.837
    got = filtered(temperature=2.0, top_p=0.6)
    s = BASE.sqrt()
    expected = torch.tensor([0, s[1], 0, s[3]]) / (s[1] + s[3])
    torch.testing.assert_close(got, expected)


def test_top_k_ties_keep_lower_token_ids():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5]])
    probs = target_probs(logits, *probs_tensors([SamplingParams(top_k=2)]))
    assert (probs[0] > 0).tolist() == [False, True, True, False, False]
    torch.testing.assert_close(probs[0, 1:3], torch.tensor([0.5, 0.5]))


def test_target_probs_rows_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(), SamplingParams(temperature=0),
              SamplingParams(top_p=0.8, min_p=0.05), SamplingParams(temperature=1.3, top_p=0.5),
              SamplingParams(temperature=0.9, top_k=1)]
    batched = target_probs(logits, *probs_tensors(params))
    for i, p in enumerate(params):
        alone = target_probs(logits[i:i + 1], *probs_tensors([p]))
        assert torch.equal(alone[0], batched[i]), f"row {i} differs alone vs batched"
    torch.testing.assert_close(batched.sum(-1), torch.ones(6))


def test_target_probs_fp32_from_bf16_logits():
    logits = torch.randn(2, 16).to(torch.bfloat16)
    probs = target_probs(logits, *probs_tensors([SamplingParams(top_k=4), SamplingParams()]))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs[1], torch.softmax(logits[1].float(), -1))
    assert int((probs[0] > 0).sum()) == 4


# ---------------------------------------------------------------- sampling


def draw(params: list[SamplingParams], logits: torch.Tensor, seeds: list[int], counters: list[int],
         **kw) -> torch.Tensor:
    """The engine's sampling call: per-row uniforms from (seed, counter), then ``sample``."""
    u = uniforms(torch.tensor(seeds), torch.tensor(counters), Stream.SAMPLE, 1)[:, 0]
    return sample(logits, *probs_tensors(params), u, **kw)


def test_seeded_sampling_same_alone_and_in_mixed_batch():
    torch.manual_seed(1)
    vocab, steps = 200, 12
    logits = torch.randn(steps, 4, vocab) * 2
    params = [SamplingParams(temperature=1.2, seed=7), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=50, seed=99)]
    seeds = [request_seed(p.seed, 123, rid) for rid, p in enumerate(params)]
    batched = torch.stack([draw(params, logits[s], seeds, [s] * 4) for s in range(steps)])

    for row in (0, 3):
        alone = torch.stack([draw([params[row]], logits[s, row:row + 1], [seeds[row]], [s])
                             for s in range(steps)])
        assert torch.equal(alone[:, 0], batched[:, row])
    assert torch.equal(batched[:, 1], logits[:, 1].argmax(-1))
    assert len(set(batched[:, 0].tolist())) > 3  # really sampled, not stuck on one token


def test_greedy_rows_ignore_their_uniforms():
    logits = torch.randn(3, 10)
    params = [SamplingParams(temperature=0)] * 3
    for u in (torch.zeros(3, dtype=torch.float64), torch.full((3,), 0.999, dtype=torch.float64)):
        assert torch.equal(sample(logits, *probs_tensors(params), u), logits.argmax(-1))
    assert torch.equal(sample(logits, *probs_tensors(params), None, greedy_only=True), logits.argmax(-1))
    with pytest.raises(ValueError, match="uniforms"):
        sample(logits, *probs_tensors([SamplingParams(temperature=1.0)] * 3), None)


def test_request_seed():
    assert request_seed(3, 0, 0) == request_seed(3, 99, 5) == 3
    assert request_seed(2**64 - 1, 0, 0) == -1            # uint64 seeds stored two's-complement
    derived = [request_seed(None, 0, rid) for rid in range(50)]
    assert len(set(derived)) == 50
    assert derived == [request_seed(None, 0, rid) for rid in range(50)]    # reproducible
    assert request_seed(None, 1, 0) != request_seed(None, 0, 0)           # --random-seed matters
    assert all(-2**63 <= s < 2**63 for s in derived)


def test_uniforms_are_a_pure_function_of_seed_counter_stream_index():
    seeds = torch.tensor([0, 1, -5, 2**40, 2**62])
    counters = torch.tensor([0, 0, 3, 7, 2**31])
    u = uniforms(seeds, counters, Stream.COIN, 4)
    assert u.shape == (5, 4) and u.dtype == torch.float64
    assert ((u >= 0) & (u < 1)).all()
    assert torch.equal(u, uniforms(seeds, counters, Stream.COIN, 4))
    for i in range(5):                                    # a row does not depend on its batch
        assert torch.equal(u[i], uniforms(seeds[i:i + 1], counters[i:i + 1], Stream.COIN, 4)[0])
    assert torch.equal(u[:, :2], uniforms(seeds, counters, Stream.COIN, 2))   # width is a prefix
    assert not torch.equal(u, uniforms(seeds, counters, Stream.BONUS, 4))
    assert not torch.equal(u, uniforms(seeds, counters + 1, Stream.COIN, 4))
    assert len(set(u.flatten().tolist())) == 20


def test_uniforms_are_uniform_and_independent():
    """Chi-square on 20 bins over consecutive seeds and consecutive counters, and on 8 x 8
    bins of pairs that the engine uses together (neighbouring counters, two streams). Five
    tests: each at 0.002, so the family is at 0.01 (Bonferroni)."""
    n = 40_000
    idx = torch.arange(n)
    edges = torch.linspace(0, 1, 21, dtype=torch.float64)[1:-1]
    for u in (uniforms(idx, torch.zeros(n, dtype=torch.long), Stream.SAMPLE, 1)[:, 0],
              uniforms(torch.full((n,), 7), idx, Stream.SAMPLE, 1)[:, 0],
              uniforms(torch.tensor([7]), torch.tensor([0]), Stream.COIN, n)[0]):
        counts = torch.bincount(torch.bucketize(u, edges), minlength=20)
        assert_distribution(counts, torch.full((20,), 0.05), min_p_value=0.002)
    seeds = torch.arange(n) * 3 + 11
    pairs = [(uniforms(seeds, idx, Stream.SAMPLE, 1)[:, 0], uniforms(seeds, idx + 1, Stream.SAMPLE, 1)[:, 0]),
             (uniforms(seeds, idx, Stream.COIN, 1)[:, 0], uniforms(seeds, idx, Stream.BONUS, 1)[:, 0])]
    e8 = torch.linspace(0, 1, 9, dtype=torch.float64)[1:-1]
    for a, b in pairs:
        cell = torch.bucketize(a, e8) * 8 + torch.bucketize(b, e8)
        assert_distribution(torch.bincount(cell, minlength=64), torch.full((64,), 1 / 64), min_p_value=0.002)


def test_zero_probability_tokens_never_sampled():
    probs = torch.zeros(1, 12)
    probs[0, [1, 4, 5, 10]] = torch.tensor([0.3, 1e-7, 0.5, 0.2])  # zeros first, between, last
    n = 100_000
    u = uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long), Stream.SAMPLE, 1)[:, 0]
    tokens = inverse_cdf_sample(probs.expand(n, -1), u)
    assert set(tokens.unique().tolist()) <= {1, 4, 5, 10}
    # edge uniforms: 0 hits the first token with mass, the largest u below 1 the last one
    edge = torch.tensor([0.0, 1.0 - 2.0**-53, 1.0, 0.3, 0.3 + 1e-7], dtype=torch.float64)
    got = inverse_cdf_sample(probs.expand(5, -1), edge)
    assert got.tolist()[:3] == [1, 10, 10]
    assert set(got.tolist()) <= {1, 4, 5, 10}


def test_inverse_cdf_unnormalised_weights_and_empty_rows():
    w = torch.tensor([[0.0, 2.0, 0.0, 6.0]])
    assert inverse_cdf_sample(w, torch.tensor([0.2])).tolist() == [1]
    assert inverse_cdf_sample(w, torch.tensor([0.25])).tolist() == [3]
    with pytest.raises(ValueError, match="no probability mass"):
        inverse_cdf_sample(torch.zeros(2, 3), torch.tensor([0.1, 0.2]), check=True)


def test_inverse_cdf_sampling_matches_distribution():
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(8), -1)
    probs[2] = 0
    probs = probs / probs.sum()
    n = 40_000
    u = uniforms(torch.arange(n) + 5, torch.zeros(n, dtype=torch.long), Stream.SAMPLE, 1)[:, 0]
    tokens = inverse_cdf_sample(probs.expand(n, -1), u)
    assert_distribution(torch.bincount(tokens, minlength=8), probs)


@pytest.mark.parametrize("filters", [True, False])
def test_sample_matches_filtered_distribution(filters):
    params = SamplingParams(temperature=0.8, top_k=3, top_p=0.95) if filters else SamplingParams(temperature=0.8)
    logits = BASE.log()
    expected = target_probs(logits[None], *probs_tensors([params]))[0]
    n = 30_000
    tokens = draw([params] * n, logits.expand(n, -1), list(range(n)), [0] * n, filters=filters)
    assert_distribution(torch.bincount(tokens, minlength=4), expected)
    assert (expected[0] == 0) == filters


def test_target_probs_without_filter_pass_is_identical():
    """filters=False is a promise that no row filters; then it must change nothing."""
    logits = torch.randn(5, 30)
    params = [SamplingParams(temperature=t) for t in (0.0, 0.5, 1.0, 1.7, 0.0)]
    assert torch.equal(target_probs(logits, *probs_tensors(params)),
                       target_probs(logits, *probs_tensors(params), filters=False))


def test_logprobs_of_raw_logits_and_tempered():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    tokens = torch.tensor([1, 0])
    raw = logprobs_of(logits, tokens)
    torch.testing.assert_close(raw, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
    tempered = logprobs_of(logits, tokens, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(tempered[0], torch.log_softmax(logits[0] / 0.5, -1)[1])
    torch.testing.assert_close(tempered[1], raw[1])
    assert math.isclose(float(raw.exp().sum()), float(torch.softmax(logits, -1)[[0, 1], [1, 0]].sum()), rel_tol=1e-6)
