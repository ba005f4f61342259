"""DSpark Markov heads (vanilla, gated, rnn) and the sequential block walk."""
from __future__ import annotations

import pytest
import torch

from blockspec.configs.draft import DraftConfigError, parse_draft_config
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.draft import build_draft_model
from blockspec.models.dspark import (
    DSparkDraftModel,
    GatedMarkovHead,
    RnnMarkovHead,
    VanillaMarkovHead,
    build_markov_head,
    run_markov_block,
)
from blockspec.sampling import Stream, uniforms

H, V, R = 12, 10, 4


def cfg_dict(head="vanilla", **over):
    d = {
        "architectures": ["Qwen3DSparkModel"],
        "hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 6, "intermediate_size": 16, "vocab_size": V,
        "mask_token_id": V - 1, "target_layer_ids": [1, 3], "markov_rank": R,
        "markov_head_type": head, "block_size": 3,
    }
    d.update(over)
    return d


def make_head(head_type, seed=0):
    head = build_markov_head(parse_draft_config(cfg_dict(head_type)), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    return head


def test_head_classes_and_parameter_names():
    expected = {
        "vanilla": (VanillaMarkovHead, {"markov_w1.weight": (V, R), "markov_w2.weight": (V, R)}),
        "gated": (GatedMarkovHead, {"markov_w1.weight": (V, R), "markov_w2.weight": (V, R),
                                    "gate_proj.weight": (R, H + R), "gate_proj.bias": (R,)}),
        "rnn": (RnnMarkovHead, {"markov_w1.weight": (V, R), "markov_w2.weight": (V, R),
                                "joint_proj.weight": (3 * R, 2 * R + H),
                                "joint_proj.bias": (3 * R,)}),
    }
    for t, (cls, shapes) in expected.items():
        head = make_head(t)
        assert type(head) is cls
        assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == shapes


def test_vanilla_bias_is_w2_w1_prev():
    head = make_head("vanilla")
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    prev = torch.tensor([3, 0, 7])
    bias, state = head.step(prev, torch.randn(3, H), None)
    assert state is None
    torch.testing.assert_close(bias, w1[prev] @ w2.T)
    # independent of h
    torch.testing.assert_close(head.step(prev, torch.randn(3, H), None)[0], bias)
    # a rank-r bigram table
    table = w2 @ w1.T                                   # [V_next, V_prev]
    torch.testing.assert_close(bias, table[:, prev].T)


def test_gated_head_by_hand():
    head = make_head("gated", seed=1)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    wg, bg = head.gate_proj.weight, head.gate_proj.bias
    prev = torch.tensor([2, 9])
    h = torch.randn(2, H)
    bias, _ = head.step(prev, h, None)
    for r in range(2):
        e = w1[prev[r]]
        g = torch.sigmoid(wg[:, :H] @ h[r] + wg[:, H:] @ e + bg)   # input order [h ; e]
        torch.testing.assert_close(bias[r], w2 @ (g * e))


def test_rnn_head_two_steps_by_hand():
    head = make_head("rnn", seed=2)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    wj, bj = head.joint_proj.weight, head.joint_proj.bias
    prevs = [torch.tensor([1, 4]), torch.tensor([5, 5])]
    hs = [torch.randn(2, H), torch.randn(2, H)]
    state = None
    s_ref = torch.zeros(2, R)                           # zero state at block start
    for prev, h in zip(prevs, hs):
        bias, state = head.step(prev, h, state)
        for r in range(2):
            e = w1[prev[r]]
            z = wj @ torch.cat([s_ref[r], e, h[r]]) + bj    # input order [s ; e ; h]
            a, c, o = z[:R], z[R:2 * R], z[2 * R:]
            torch.testing.assert_close(bias[r], w2 @ torch.tanh(o))
            s_ref[r] = torch.sigmoid(a) * s_ref[r] + (1 - torch.sigmoid(a)) * torch.tanh(c)
        torch.testing.assert_close(state, s_ref)
    assert state.abs().sum() > 0


def test_build_markov_head_rules():
    cfg = parse_draft_config(cfg_dict("gated"))
    with pytest.raises(DraftConfigError, match="vanilla"):
        build_markov_head(cfg, is_nemotron_35=True)
    assert isinstance(build_markov_head(parse_draft_config(cfg_dict("vanilla")),
                                        is_nemotron_35=True), VanillaMarkovHead)
    cfg.markov_rank = 0
    with pytest.raises(DraftConfigError, match="markov_rank"):
        build_markov_head(cfg)
    cfg.markov_rank, cfg.markov_head_type = R, "attn"
    with pytest.raises(DraftConfigError, match="attn"):
        build_markov_head(cfg)


# ---- the sequential walk ------------------------------------------------------------------

def walk_inputs(b=3, gamma=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, gamma, V, generator=g), torch.randn(b, gamma, H, generator=g),
            torch.randint(0, V, (b,), generator=g))


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_greedy_walk_equals_step_by_step_argmax(head_type):
    head = make_head(head_type, seed=4)
    base, hidden, anchor = walk_inputs()
    b, gamma, _ = base.shape
    tokens, q = run_markov_block(head, base, hidden, anchor, torch.zeros(b), greedy_only=True)
    t2, q2 = run_markov_block(head, base, hidden, anchor, torch.zeros(b), torch.rand(b, gamma))
    assert torch.equal(t2, tokens) and torch.equal(q2, q)    # greedy rows ignore their uniforms
    t3, q3 = run_markov_block(head, base, hidden, anchor, torch.zeros(b), greedy_only=True,
                              with_probs=False)
    assert torch.equal(t3, tokens) and q3 is None
    prev, state = anchor, None
    for k in range(gamma):
        bias, state = head.step(prev, hidden[:, k], state)
        expect = (base[:, k] + bias).argmax(-1)
        assert torch.equal(tokens[:, k], expect)
        assert torch.equal(q[:, k], torch.nn.functional.one_hot(expect, V).float())
        prev = expect
    assert q.dtype == torch.float32


def test_walk_feeds_back_drafted_tokens():
    """The bias at slot k must use x_{k-1} (not the anchor, not the base argmax)."""
    # a dense bigram "next = prev + 1 (mod V)" as a head
    class Bigram(VanillaMarkovHead):
        def step(self, prev, h, state):
            return 50.0 * torch.nn.functional.one_hot((prev + 1) % V, V).float(), state
    bigram = Bigram(V, R, H, None, torch.float32)
    base, hidden, _ = walk_inputs(b=2, gamma=5)
    anchor = torch.tensor([2, 7])
    tokens, _ = run_markov_block(bigram, base, hidden, anchor, torch.zeros(2), greedy_only=True)
    assert tokens.tolist() == [[3, 4, 5, 6, 7], [8, 9, 0, 1, 2]]


def walk_uniforms(seeds: list[int], counter: int, gamma: int) -> torch.Tensor:
    return uniforms(torch.tensor(seeds), torch.full((len(seeds),), counter), Stream.DRAFT, gamma)


def test_sampled_walk_reproducible_and_probs_exact():
    head = make_head("rnn", seed=6)
    base, hidden, anchor = walk_inputs(b=3, gamma=4, seed=7)
    temp = torch.tensor([0.7, 0.0, 1.3])          # row 1 greedy

    def run(seeds, **kw):
        return run_markov_block(head, base, hidden, anchor, temp, walk_uniforms(seeds, 0, 4), **kw)

    t1, q1, l1 = run([11, 0, 13], return_logits=True)
    t2, q2 = run([11, 0, 13])
    assert torch.equal(t1, t2) and torch.equal(q1, q2)
    # draft_probs are exactly softmax(corrected logits / T) along the tokens actually drawn
    prev, state = anchor, None
    for k in range(4):
        bias, state = head.step(prev, hidden[:, k], state)
        logits = base[:, k] + bias
        torch.testing.assert_close(l1[:, k], logits)
        for r in (0, 2):
            assert torch.equal(q1[r, k], torch.softmax(logits[r] / temp[r], -1))
        assert torch.equal(q1[1, k], torch.nn.functional.one_hot(logits[1].argmax(), V).float())
        prev = t1[:, k]
    # the seeds matter: other seeds give another block somewhere over a few tries
    assert any(not torch.equal(run([s, 0, s + 1])[0], t1) for s in range(20, 30))
    # a seeded row does not depend on its batch neighbours
    t3, _ = run([11, 99, 13])
    assert torch.equal(t3[[0, 2]], t1[[0, 2]])
    solo = run_markov_block(head, base[:1], hidden[:1], anchor[:1], temp[:1], walk_uniforms([11], 0, 4))[0]
    assert torch.equal(solo[0], t1[0])


def test_sampling_follows_the_draft_distribution():
    head = make_head("vanilla", seed=8)
    n = 6000
    base = torch.randn(1, 1, V).expand(n, 1, V).contiguous()
    hidden = torch.zeros(n, 1, H)
    anchor = torch.full((n,), 3)
    temp = torch.full((n,), 0.8)
    tokens, q = run_markov_block(head, base, hidden, anchor, temp, walk_uniforms(list(range(n)), 0, 1))
    freq = torch.bincount(tokens[:, 0], minlength=V).float() / n
    assert (freq - q[0, 0]).abs().max() < 0.03
    assert len(set(tokens[:, 0].tolist())) > 1


def test_zero_temperature_row_is_greedy_and_finite():
    head = make_head("gated", seed=9)
    base, hidden, anchor = walk_inputs(b=1, gamma=3)
    t, q = run_markov_block(head, base, hidden, anchor, torch.tensor([0.0]), walk_uniforms([0], 0, 3))
    assert torch.isfinite(q).all()
    g, _ = run_markov_block(head, base, hidden, anchor, torch.tensor([0.0]), greedy_only=True)
    assert torch.equal(t, g)
    with pytest.raises(ValueError, match="uniforms"):
        run_markov_block(head, base, hidden, anchor, torch.tensor([1.0]))


# ---- the full DSpark model ----------------------------------------------------------------

class RecordingPlan:
    def __init__(self):
        self.prefixes = []

    def format_for(self, prefix):
        self.prefixes.append(prefix)
        return None


def test_dspark_model_prefixes_and_names():
    plan = RecordingPlan()
    cfg = parse_draft_config(cfg_dict("gated"))
    model = build_draft_model(cfg, quant=plan)
    assert isinstance(model, DSparkDraftModel) and isinstance(model, DFlashDraftModel)
    for p in ("fc", "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
              "layers.0.self_attn.v_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_proj",
              "layers.0.mlp.up_proj", "layers.0.mlp.down_proj", "markov_head.markov_w2",
              "markov_head.gate_proj"):
        assert p in plan.prefixes, p
    names = set(model.state_dict())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "markov_head.gate_proj.weight", "markov_head.gate_proj.bias",
            "fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    with pytest.raises(DraftConfigError, match="DSpark"):
        DSparkDraftModel(parse_draft_config(dict(cfg_dict(), architectures=["DFlashDraftModel"])))


def test_dspark_end_to_end_shapes_both_layouts():
    for sfa, q_rows in ((True, 3), (False, 4)):
        cfg = parse_draft_config(cfg_dict("vanilla", sample_from_anchor=sfa))
        model = build_draft_model(cfg)
        model.init_random_(std=0.3, generator=torch.Generator().manual_seed(0))
        ids, pos = model.block_inputs(torch.tensor([1, 2]), torch.tensor([4, 6]))
        assert ids.shape == (2, q_rows)
        table = torch.randn(V, H)
        x = model.embed_block(ids, table)
        feats = torch.randn(6, 2 * H)
        kv = model.project_context(feats, torch.arange(6))
        ks = [k.expand(2, -1, -1, -1) for k, _ in kv]
        vs = [v.expand(2, -1, -1, -1) for _, v in kv]
        valid = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
        h = model.select_draft_hidden(model.forward_block(x, pos, ks, vs, valid))
        assert h.shape == (2, cfg.gamma, H)
        base = h @ table.T
        tokens, q = model.markov_walk(base, h, torch.tensor([1, 2]), torch.tensor([0.0, 1.0]),
                                      walk_uniforms([0, 3], 0, cfg.gamma))
        assert tokens.shape == (2, cfg.gamma) and q.shape == (2, cfg.gamma, V)
        torch.testing.assert_close(q.sum(-1), torch.ones(2, cfg.gamma))
