"""Speculative acceptance: greedy exact match and lossless rejection sampling (CPU, fp32).

The rejection tests compare Monte-Carlo frequencies against distributions computed exactly
by enumeration, and check that every acceptance length the case is meant to exercise
actually occurred.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from blockspec.sampling import SamplingParams, Stream, params_to_tensors, target_probs, uniforms
from blockspec.speculative.accept import (
    greedy_accept,
    rejection_accept,
    verify_block,
)


def assert_distribution(observed: dict, expected: dict, min_p_value: float = 0.01) -> None:
    """Chi-square over cells (dict keys); impossible cells must never occur and cells with
    an expected count below 5 are pooled."""
    total = sum(observed.values())
    impossible = {k: v for k, v in observed.items() if expected.get(k, 0.0) <= 0}
    assert not impossible, f"outcomes with probability 0 occurred: {impossible}"
    keys = [k for k, p in expected.items() if p > 0]
    exp = torch.tensor([expected[k] for k in keys], dtype=torch.float64)
    exp = exp / exp.sum() * total
    obs = torch.tensor([observed.get(k, 0) for k in keys], dtype=torch.float64)
    small = exp < 5
    if small.any():
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
    p_value = chisquare(obs.numpy(), exp.numpy()).pvalue
    assert p_value > min_p_value, f"chi-square p={p_value:.2e}\nobserved={obs}\nexpected={exp}"


def coins(b: int, n: int, seed: int) -> torch.Tensor:
    """[b, n+1] fp64 uniforms: acceptance coins then the bonus draw (rejection_accept's u)."""
    return torch.rand(b, n + 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def engine_uniforms(seeds: list[int], counter: int, n: int) -> torch.Tensor:
    """The uniforms the engine hands verify_block for one step (COIN stream, then BONUS)."""
    s, c = torch.tensor(seeds), torch.full((len(seeds),), counter)
    return torch.cat([uniforms(s, c, Stream.COIN, n), uniforms(s, c, Stream.BONUS, 1)], dim=1)


def committed_tokens(drafts: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor) -> list[list[int]]:
    """Per row, the tokens a step commits: drafts[:a] + [bonus] (as the worker assembles them)."""
    return [row[:a] + [t] for row, a, t in zip(drafts.tolist(), accept_len.tolist(), bonus.tolist())]


def random_dist(*shape: int, gen: torch.Generator, sparsity: float = 0.0) -> torch.Tensor:
    """Random normalised distributions over the last dim, some entries exactly zero."""
    w = torch.rand(*shape, generator=gen, dtype=torch.float64) + 0.05
    if sparsity:
        w = w * (torch.rand(*shape, generator=gen, dtype=torch.float64) >= sparsity)
        w[..., 0] += 0.05  # never an all-zero row
    return (w / w.sum(-1, keepdim=True)).float()


# ---------------------------------------------------------------- greedy


def logits_with_argmax(t: list[list[int]], vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[B, len, V] random logits whose argmax at [b, i] is t[b][i]."""
    t_ = torch.tensor(t)
    x = torch.rand(*t_.shape, vocab, generator=gen)
    x.scatter_(-1, t_[..., None], 2.0)
    return x


def test_greedy_accept_every_length():
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    t = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 5, 0]]
    drafts = torch.tensor([
        [0, 2, 3],  # a = 0 (the later matches must not count)
        [1, 0, 3],  # a = 1
        [1, 2, 0],  # a = 2
        [1, 2, 3],  # a = 3, bonus from row n
        [5, 0, 1],  # a = 2
    ])
    a, bonus = greedy_accept(drafts, logits_with_argmax(t, vocab, gen))
    assert a.tolist() == [0, 1, 2, 3, 2]
    assert bonus.tolist() == [1, 2, 3, 4, 5]
    assert committed_tokens(drafts, a, bonus) == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [5, 0, 5]]


def test_greedy_accept_ties_take_first_max_and_bf16():
    logits = torch.tensor([[[0.0, 3.0, 3.0], [1.0, 1.0, 0.0]]]).to(torch.bfloat16)
    a, bonus = greedy_accept(torch.tensor([[1]]), logits)
    assert (a.item(), bonus.item()) == (1, 0)
    a, bonus = greedy_accept(torch.tensor([[2]]), logits)
    assert (a.item(), bonus.item()) == (0, 1)


def test_greedy_accept_no_drafts():
    logits = torch.tensor([[[0.0, 2.0, 1.0]], [[3.0, 2.0, 1.0]]])
    a, bonus = greedy_accept(torch.zeros(2, 0, dtype=torch.long), logits)
    assert a.tolist() == [0, 0] and bonus.tolist() == [1, 0]


def test_greedy_accept_shape_errors():
    with pytest.raises(ValueError, match=r"\[B, n\+1, V\]"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5))


def markov_chain(vocab: int, gen: torch.Generator, scale: float = 2.0) -> torch.Tensor:
    """Toy target: next-token logits depend only on the previous token ([V, V])."""
    return torch.randn(vocab, vocab, generator=gen) * scale


def test_greedy_spec_loop_equals_target_greedy_decoding():
    gen = torch.Generator().manual_seed(1)
    vocab, n, length = 5, 4, 40
    table = markov_chain(vocab, gen)
    reference = [0]
    for _ in range(length):
        reference.append(int(table[reference[-1]].argmax()))

    out, lengths = [0], Counter()
    while len(out) < length + 1:
        anchor = out[-1]
        # drafts: follow the true greedy chain with probability .7 per slot, else random
        drafts, prev = [], anchor
        for _ in range(n):
            good = int(table[prev].argmax())
            d = good if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(vocab, (1,), generator=gen))
            drafts.append(d)
            prev = d
        cand = [anchor] + drafts
        logits = table[torch.tensor(cand)][None]  # [1, n+1, V]
        a, bonus = greedy_accept(torch.tensor([drafts]), logits)
        lengths[int(a)] += 1
        out += committed_tokens(torch.tensor([drafts]), a, bonus)[0]
    assert out[:length + 1] == reference
    assert set(lengths) == set(range(n + 1)), f"not every accept length exercised: {lengths}"


# ---------------------------------------------------------------- rejection: exact tables


def exact_outcomes(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int]) -> dict:
    """P(accept_len = a, bonus = y) for fixed drafts, by enumeration (fp64)."""
    p = p.double()
    n = len(drafts)
    out: dict = {}
    reach = 1.0
    for j, d in enumerate(drafts):
        if q is None:
            acc = float(p[j, d])
            residual = p[j].clone()
            residual[d] = 0
        else:
            qd = float(q[j, d])
            acc = 1.0 if qd == 0 else min(1.0, float(p[j, d]) / qd)
            residual = (p[j] - q[j].double()).clamp_min(0)
        if acc < 1:
            residual = residual / residual.sum()
            for y in range(p.shape[-1]):
                out[(j, y)] = out.get((j, y), 0.0) + reach * (1 - acc) * float(residual[y])
        reach *= acc
    for y in range(p.shape[-1]):
        out[(n, y)] = out.get((n, y), 0.0) + reach * float(p[n, y])
    return out


def run_many(p, q, drafts, samples, seed):
    """One row per sample, all rows sharing the fallback generator."""
    b = samples
    d = torch.tensor(drafts).expand(b, -1)
    qq = q.expand(b, -1, -1) if q is not None else None
    a, bonus = rejection_accept(d, qq, p.expand(b, -1, -1), coins(b, len(drafts), seed))
    return Counter(zip(a.tolist(), bonus.tolist()))


CASES = {
    # V=3, n=1: q puts more mass on the draft than p, so it is sometimes rejected
    "v3_n1": (
        torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]]),
        torch.tensor([[0.1, 0.8, 0.1]]),
        [1],
    ),
    # V=4, n=2: first draft has p > q (always accepted), second p < q
    "v4_n2_first_sure": (
        torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.4, 0.1], [0.0, 0.3, 0.3, 0.4]]),
        torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.1, 0.1, 0.7, 0.1]]),
        [1, 2],
    ),
    # V=4, n=2: both drafts can be rejected; zero entries in p and q
    "v4_n2_zeros": (
        torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.1, 0.6, 0.0, 0.3], [0.2, 0.2, 0.2, 0.4]]),
        torch.tensor([[0.1, 0.0, 0.4, 0.5], [0.0, 0.9, 0.1, 0.0]]),
        [3, 1],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_accept_matches_exact_enumeration(name, point_mass):
    p, q, drafts = CASES[name]
    if point_mass:
        q = None
    expected = exact_outcomes(p, q, drafts)
    assert abs(sum(expected.values()) - 1) < 1e-6
    observed = run_many(p, q, drafts, samples=20_000, seed=10 * sorted(CASES).index(name) + int(point_mass))
    assert_distribution(observed, expected)
    lengths = {a for (a, _), prob in expected.items() if prob > 1e-3}
    assert lengths == {a for a, _ in observed}, "an acceptance length that should occur did not"


def test_enumeration_is_not_trivial():
    """The hand-made cases must exercise several acceptance lengths, else the test is weak."""
    for p, q, drafts in CASES.values():
        for qq in (q, None):
            lengths = {a for (a, _), prob in exact_outcomes(p, qq, drafts).items() if prob > 0}
            assert len(lengths) >= 2


def test_residual_is_max_p_minus_q_not_p():
    """A rejected draft's bonus follows normalize(max(p - q, 0)): tokens where q >= p never
    appear as the bonus after a rejection (catches 'resample from p' bugs)."""
    p, q, drafts = CASES["v3_n1"]
    observed = run_many(p, q, drafts, samples=20_000, seed=5)
    rejected_bonus = {y for (a, y) in observed if a == 0}
    assert rejected_bonus == {0, 2}  # p - q = (.1, -.3, .2)


# ---------------------------------------------------------------- losslessness


def first_two_emitted(drafts, a, bonus):
    """First emitted token per row, and the second where the first draft was accepted."""
    first = torch.where(a >= 1, drafts[:, 0], bonus)
    second = torch.where(a >= 2, drafts[:, 1], bonus)
    return first, second, a >= 1


@pytest.mark.parametrize("point_mass", [False, True])
def test_lossless_marginals_random_p_q(point_mass):
    gen = torch.Generator().manual_seed(11)
    vocab, n, b = 5, 2, 40_000
    p = random_dist(n + 1, vocab, gen=gen, sparsity=0.3)
    q = random_dist(n, vocab, gen=gen, sparsity=0.3)
    drafts = torch.multinomial(q.double(), b, replacement=True, generator=gen).T  # [B, n] from q
    if point_mass:
        # any draft chosen independently of the coins is fine for a point-mass q
        drafts = torch.randint(vocab, (b, n), generator=gen)
    a, bonus = rejection_accept(drafts, None if point_mass else q.expand(b, -1, -1),
                                p.expand(b, -1, -1), coins(b, n, 12))
    first, second, has_second = first_two_emitted(drafts, a, bonus)
    assert_distribution(Counter(first.tolist()), dict(enumerate(p[0].tolist())))
    assert_distribution(Counter(second[has_second].tolist()), dict(enumerate(p[1].tolist())))
    assert set(a.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("point_mass", [False, True])
def test_lossless_speculative_loop_joint_of_three_tokens(point_mass):
    """End to end on a Markov target: three verify steps of drafts (sampled from a different
    Markov draft, or its argmax) must produce the target's exact joint over 3 tokens."""
    gen = torch.Generator().manual_seed(21)
    vocab, n, b, steps = 3, 2, 20_000, 3
    target = torch.softmax(markov_chain(vocab, gen, 1.0), -1)  # [V, V] p(next | prev)
    draft = torch.softmax(markov_chain(vocab, gen, 1.5), -1)
    coin_gen = torch.Generator().manual_seed(22)

    anchor = torch.zeros(b, dtype=torch.long)
    emitted: list[list[int]] = [[] for _ in range(b)]
    for _ in range(steps):
        drafts, probs, prev = [], [], anchor
        for _ in range(n):
            qd = draft[prev]
            d = qd.argmax(-1) if point_mass else torch.multinomial(qd, 1, generator=gen)[:, 0]
            drafts.append(d)
            probs.append(qd)
            prev = d
        drafts_t = torch.stack(drafts, 1)
        cand = torch.cat([anchor[:, None], drafts_t], 1)
        p = target[cand]  # [B, n+1, V]
        q = None if point_mass else torch.stack(probs, 1)
        u = torch.rand(b, n + 1, generator=coin_gen, dtype=torch.float64)
        a, bonus = rejection_accept(drafts_t, q, p, u)
        for row, toks in zip(emitted, committed_tokens(drafts_t, a, bonus)):
            row.extend(toks)
        anchor = bonus

    observed = Counter(tuple(r[:3]) for r in emitted)
    expected = {}
    for x1 in range(vocab):
        for x2 in range(vocab):
            for x3 in range(vocab):
                expected[(x1, x2, x3)] = float(target[0, x1] * target[x1, x2] * target[x2, x3])
    assert_distribution(observed, expected)


def test_point_mass_certain_target_always_accepts():
    drafts = torch.tensor([[2, 0], [1, 1]])
    p = torch.nn.functional.one_hot(torch.tensor([[2, 0, 1], [1, 1, 3]]), 4).float()
    a, bonus = rejection_accept(drafts, None, p, coins(2, 2, 0))
    assert a.tolist() == [2, 2] and bonus.tolist() == [1, 3]


def test_degenerate_residual_falls_back_to_p():
    # p <= q everywhere (p not normalised: outside the contract, but the guard must hold):
    # max(p - q, 0) is all zero, so a rejected draft draws its bonus from p instead.
    p = torch.tensor([[[0.2, 0.2, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]]).expand(500, -1, -1)
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]]).expand(500, -1, -1)
    drafts = torch.zeros(500, 1, dtype=torch.long)
    a, bonus = rejection_accept(drafts, q, p, coins(500, 1, 3))
    assert (a == 0).any()
    assert set(bonus[a == 0].tolist()) <= {0, 1}


def test_no_drafts_samples_from_row_zero():
    p = torch.tensor([[[0.0, 0.7, 0.3]]]).expand(5_000, -1, -1)
    a, bonus = rejection_accept(torch.zeros(5_000, 0, dtype=torch.long), None, p, coins(5_000, 0, 4))
    assert (a == 0).all()
    assert_distribution(Counter(bonus.tolist()), {0: 0.0, 1: 0.7, 2: 0.3})


# ---------------------------------------------------------------- verify_block


def test_verify_block_mixed_batch():
    gen = torch.Generator().manual_seed(31)
    vocab, n = 8, 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=0.7, top_k=1),  # greedy too
              SamplingParams(temperature=1.1, top_p=0.8, seed=2)]
    b = len(params)
    logits = torch.randn(b, n + 1, vocab, generator=gen) * 2
    drafts = logits[:, :n].argmax(-1)
    drafts[0, 1] = (drafts[0, 1] + 1) % vocab  # greedy row 0 rejects at 1
    q = random_dist(b, n, vocab, gen=gen)
    u = coins(b, n, 0)
    a, bonus = verify_block(drafts, logits, q, *params_to_tensors(params), u)

    ga, gb = greedy_accept(drafts[[0, 2]], logits[[0, 2]])
    assert a[[0, 2]].tolist() == ga.tolist() and bonus[[0, 2]].tolist() == gb.tolist()
    assert a[0].item() == 1

    for row in (1, 3):
        t, k, tp, mp = params_to_tensors([params[row]] * (n + 1), "cpu")
        p = target_probs(logits[row], t, k, tp, mp)[None]
        ra, rb = rejection_accept(drafts[row:row + 1], q[row:row + 1], p, u[row:row + 1])
        assert (a[row].item(), bonus[row].item()) == (ra.item(), rb.item())
    # the host-side promises skip work and change nothing
    greedy = [params[0], params[2]]
    ga2, gb2 = verify_block(drafts[[0, 2]], logits[[0, 2]], None, *params_to_tensors(greedy), None,
                            greedy_only=True)
    assert ga2.tolist() == ga.tolist() and gb2.tolist() == gb.tolist()


def test_verify_block_greedy_rows_ignore_uniforms():
    logits = torch.randn(2, 3, 6)
    drafts = logits[:, :2].argmax(-1)
    t = params_to_tensors([SamplingParams(temperature=0)] * 2)
    outs = {tuple(map(tuple, (x.tolist() for x in verify_block(drafts, logits, None, *t, u))))
            for u in (coins(2, 2, 1), coins(2, 2, 2), torch.zeros(2, 3, dtype=torch.float64))}
    assert len(outs) == 1
    with pytest.raises(ValueError, match="uniforms"):
        verify_block(drafts, logits, None, *params_to_tensors([SamplingParams(temperature=1.0)] * 2), None)


def test_verify_block_seeded_rows_same_alone_and_batched():
    gen = torch.Generator().manual_seed(41)
    vocab, n, steps = 6, 4, 25
    params = [SamplingParams(temperature=1.0, seed=100), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0), SamplingParams(temperature=1.3, min_p=0.05, seed=200)]
    b = len(params)
    seeds = [100, 12345, 0, 200]
    lengths = Counter()
    for step in range(steps):
        logits = torch.randn(b, n + 1, vocab, generator=gen)
        drafts = torch.randint(vocab, (b, n), generator=gen)
        drafts[:, 0] = logits[:, 0].argmax(-1)  # make acceptance likely enough to vary
        q = random_dist(b, n, vocab, gen=gen)
        a, bonus = verify_block(drafts, logits, q, *params_to_tensors(params),
                                engine_uniforms(seeds, step, n))
        for r in (0, 3):
            ra, rb = verify_block(drafts[r:r + 1], logits[r:r + 1], q[r:r + 1],
                                  *params_to_tensors([params[r]]), engine_uniforms([seeds[r]], step, n))
            assert (ra.item(), rb.item()) == (a[r].item(), bonus[r].item())
            lengths[a[r].item()] += 1
    assert len(lengths) >= 2


def test_verify_block_point_mass_sampled_rows():
    gen = torch.Generator().manual_seed(51)
    logits = torch.randn(3, 3, 5, generator=gen)
    drafts = torch.randint(5, (3, 2), generator=gen)
    params = [SamplingParams(temperature=0.5, seed=s) for s in (1, 2, 3)]
    a1, b1 = verify_block(drafts, logits, None, *params_to_tensors(params), engine_uniforms([1, 2, 3], 0, 2))
    a2, b2 = verify_block(drafts, logits, None, *params_to_tensors(params), engine_uniforms([1, 2, 3], 0, 2))
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert ((a1 >= 0) & (a1 <= 2)).all()
