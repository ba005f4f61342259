"""Adaptive verify width: the chooser's arithmetic, the on-device acceptance EWMA, and
losslessness at every width (greedy token-exact, sampling law by chi-square) for DFlash and
DSpark, with forced width sequences and with the real chooser."""
from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch

from blockspec import Engine
from blockspec.sampling import SamplingParams
from blockspec.speculative.adaptive import (
    AcceptanceEWMA,
    CostTable,
    WidthChooser,
    candidate_widths,
    eager_size,
    eager_timed_widths,
    expected_tokens,
)
from tests.spec_fixtures import (
    draft_config,
    make_spec_target,
    two_token_chi_square_pvalue,
    write_draft,
)
from tests.test_dflash import GREEDY, HIDDEN, LAYERS, PROMPTS, VOCAB


# ---- chooser, cost table, EWMA (no model) ------------------------------------------------------
def _cost(W: int, bs: int = 16) -> CostTable:
    """A GPU-like table: a fixed step cost, and verify rows that cost more as the batch grows."""
    cost = CostTable()
    for w in range(1, W + 1):
        cost.measured[(bs, w)] = 1.0 + (0.2 if w > 1 else 0.0) + 0.05 * w
    return cost


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 1) == 1.0
    assert expected_tokens([0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 5, 6) == 6.0


@pytest.mark.parametrize("p, want", [(0.0, 1), (0.02, 1), (1.0, 6), (0.99, 6)])
def test_chooser_extremes(p, want):
    chooser = WidthChooser(range(1, 7), _cost(6))
    chooser.observe([[p] * 5, [p] * 5])
    assert chooser.choose(16) == want


def test_chooser_picks_the_best_ratio_and_batch_mean():
    chooser = WidthChooser(range(1, 7), _cost(6))
    # batch mean [0.9, 0.9, 0.1, ...]: two drafts pay, the third does not
    chooser.observe([[1.0, 0.8, 0.1, 0.1, 0.1], [0.8, 1.0, 0.1, 0.1, 0.1]])
    ratios = {w: expected_tokens(chooser.p, w) / _cost(6).time(16, w) for w in range(1, 7)}
    assert chooser.choose(16) == max(ratios, key=ratios.get) == 3


def test_chooser_probes_one_width_wider_now_and_then():
    chooser = WidthChooser(range(1, 7), _cost(6), probe_every=4, probe_share=1.0)
    chooser.observe([[0.0] * 5])
    assert [chooser.choose(16) for _ in range(8)] == [1, 1, 1, 2, 1, 1, 1, 2]
    chooser.observe([[1.0] * 5])
    assert {chooser.choose(16) for _ in range(8)} == {6}      # nothing wider to probe


@pytest.mark.parametrize("probe_cost", [0.05, 0.3, 1.0])
def test_probes_cost_at_most_their_share_of_step_time(probe_cost):
    """A probe comes every ``probe_every`` choices while it is cheap, and no more often than
    its extra time allows once it is dear (a wide verify at a large batch)."""
    cost = CostTable()
    cost.measured.update({(64, 1): 1.0, (64, 2): 1.0 + probe_cost, (64, 3): 9.0})
    chooser = WidthChooser((1, 2, 3), cost, probe_every=8, probe_share=0.01)
    chooser.observe([[0.0, 0.0]])
    picks = [chooser.choose(64) for _ in range(2000)]
    probes = [i for i, w in enumerate(picks) if w == 2]
    assert set(picks) == {1, 2} and len(probes) > 1
    gap = max(8, -(-probe_cost // 0.01))
    assert all(b - a == gap for a, b in zip(probes, probes[1:]))
    extra = probe_cost * len(probes)
    assert extra <= 0.01 * sum(cost.measured[(64, w)] for w in picks) + probe_cost


def test_plain_decoding_takes_the_margin():
    """Width 1 verifies nothing, so the chooser takes it only if it still wins with position
    1's estimate raised by blind_margin / sqrt(batch): a dip just under break-even keeps
    verifying at batch 1, not at 64 (a pooled estimate is less noisy), nor a clear low."""
    cost = CostTable()
    for bs in (1, 64):
        cost.measured.update({(bs, 1): 1.0, (bs, 2): 1.4})      # break-even at p = 0.4
    chooser = WidthChooser((1, 2), cost, probe_every=0)
    chooser.observe([[0.35]])
    assert chooser.choose(1) == 2 and chooser.choose(64) == 1
    chooser.observe([[0.25]])
    assert chooser.choose(1) == 1
    off = WidthChooser((1, 2), cost, probe_every=0, blind_margin=0.0)
    off.observe([[0.35]])
    assert off.choose(1) == 1


def test_forced_widths_round_down_to_candidates():
    chooser = WidthChooser((1, 2, 4, 8), _cost(8))
    chooser.force = iter([8, 7, 3, 1, 5])
    assert [chooser.choose(1) for _ in range(5)] == [8, 4, 2, 1, 4]


def test_candidate_widths():
    assert candidate_widths(6, adaptive=False) == (6,)
    assert candidate_widths(6, adaptive=True) == (1, 2, 3, 4, 5, 6)
    many = candidate_widths(16, adaptive=True)
    assert many[0] == 1 and many[-1] == 16 and len(many) <= 8 and list(many) == sorted(set(many))


def test_cost_table_falls_back_to_the_analytic_shape():
    cost = CostTable()
    cost.measured[(8, 3)] = 2.0
    assert cost.time(4, 3) == 2.0 and cost.time(8, 3) == 2.0        # the padded size's figure
    assert cost.time(16, 3) == CostTable.analytic(16, 3)            # above every measured size
    assert CostTable.analytic(64, 4) > CostTable.analytic(64, 2) > CostTable.analytic(64, 1)


def test_eager_size_is_the_next_power_of_two_within_the_batch_limit():
    assert [eager_size(b, 16) for b in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert eager_size(17, 24) == 24 and eager_size(40, 48) == 48 and eager_size(64, 256) == 64


def test_eager_sizes_time_three_widths_and_interpolate_the_rest():
    """An eager size is timed at the narrowest, the second and the widest width; the widths
    between are linear in the width between their timed neighbours, and a timed entry (or one
    with no timed neighbour above) is left as it is."""
    assert eager_timed_widths((1, 2, 3, 4, 5, 6, 7, 8)) == (1, 2, 8)
    assert eager_timed_widths((1, 3)) == (1, 3) and eager_timed_widths((1, 2, 4)) == (1, 2, 4)
    assert eager_timed_widths((1, 2, 3, 5, 8, 12, 16)) == (1, 2, 16)
    cost = CostTable()
    cost.measured.update({(8, 1): 17.8, (8, 2): 40.0, (8, 8): 70.0, (4, 1): 1.0, (4, 3): 3.0})
    cost.interpolate(8, range(1, 9))
    assert [round(cost.measured[(8, w)], 6) for w in range(1, 9)] == [17.8, 40, 45, 50, 55, 60,
                                                                       65, 70]
    cost.interpolate(4, (1, 2, 3, 4))               # 2 between 1 and 3; nothing timed above 4
    assert cost.measured[(4, 2)] == 2.0 and (4, 4) not in cost.measured
    assert cost.measured[(8, 1)] == 17.8 and cost.measured[(4, 3)] == 3.0


def test_ewma_update():
    e = AcceptanceEWMA(slots=3, positions=4, device=torch.device("cpu"), alpha=0.5, prior=0.8,
                       engine_alpha=0.05, engine_prior_n=2.0, stop=(7, 2))
    slot, first = torch.tensor([0, 1]), torch.tensor([0, 0])
    # width 4 (3 drafts verified): row 0 accepted 1 -> pos 0 hit, pos 1 missed, pos 2-3 unseen;
    # row 1 accepted 3 -> pos 0-2 hit, pos 3 (never verified at width 4) unseen
    cols = e.update(slot, first, torch.tensor([1, 3]), width=4)
    assert cols.dtype == torch.float64 and cols.shape == (2, 8)
    # the engine row: the running mean of the observations (2, 2, 1, 0 of them), the prior
    # counting as 2: pos 0 (0.8 * 2 + 2) / 4, pos 1 (1.6 + 1) / 4, pos 2 (1.6 + 1) / 3
    engine = [0.9, 0.65, 2.6 / 3, 0.8]
    assert e.engine.tolist() == pytest.approx(engine)
    assert e.engine_n.tolist() == [2.0, 2.0, 1.0, 0.0]
    assert cols[:, 4:].tolist() == [pytest.approx(engine)] * 2
    # new rows start from the engine row as the step leaves it, then move halfway to each hit
    assert cols[0, :4].tolist() == pytest.approx([0.95, 0.325, 2.6 / 3, 0.8])
    assert cols[1, :4].tolist() == pytest.approx([0.95, 0.825, (2.6 / 3 + 1) / 2, 0.8])
    assert e.table[0].tolist() == pytest.approx([0.95, 0.325, 2.6 / 3, 0.8])
    # width 1 (nothing verified): nothing changes, the engine row neither
    low = e.update(slot[1:], torch.tensor([1]), torch.tensor([0]), width=1)[:, :4]
    assert low[0].tolist() == pytest.approx([0.95, 0.825, (2.6 / 3 + 1) / 2, 0.8])
    assert e.engine.tolist() == pytest.approx(engine)
    # a later step of row 0 starts from its row; width 2 verifies only position 0 (a miss):
    # the engine row's pos 0 takes 1 / (3 + 2) of it
    again = e.update(slot[:1], torch.tensor([5]), torch.tensor([0]), width=2)[:, :4]
    assert again[0].tolist() == pytest.approx([0.475, 0.325, 2.6 / 3, 0.8])
    engine[0] = 0.9 - 0.9 / 5
    assert e.engine.tolist() == pytest.approx(engine)
    # a new request in a used slot (verify counter 0) starts from the engine row, at width 1 too
    fresh = e.update(slot[:1], torch.tensor([0]), torch.tensor([0]), width=1)[:, :4]
    assert fresh[0].tolist() == pytest.approx(engine)
    # the dummy slot (padding rows, the last one) never moves the engine row
    e.update(torch.tensor([2, 2]), torch.tensor([3, 3]), torch.tensor([0, 0]), width=4)
    assert e.engine.tolist() == pytest.approx(engine)
    # once the observations outweigh the prior, a step weighs engine_alpha (an EWMA)
    many = torch.arange(2)
    for _ in range(30):
        e.update(many, torch.tensor([1, 1]), torch.tensor([3, 3]), width=4)
    before = e.engine[0].item()
    e.update(many, torch.tensor([1, 1]), torch.tensor([0, 0]), width=4)
    assert e.engine[0].item() == pytest.approx(before * (1 - 0.05))
    # a row that ended (committed an end-of-sequence id) observes nothing: its misses move
    # neither its row nor the engine row; the other row's do
    rows, eng = e.table[:2].clone(), e.engine.clone()
    # (row 1's stop id comes after its committed tokens: it goes on)
    cols = e.update(many, torch.tensor([1, 1]), torch.tensor([0, 0]), width=4,
                    tokens=torch.tensor([[2, 5, 5, 5], [5, 7, 5, 5]]))
    assert torch.equal(e.table[0], rows[0]) and torch.equal(cols[0, :4].float(), rows[0])
    assert e.table[1, 0].item() == pytest.approx(rows[1, 0].item() / 2)
    assert e.engine[0].item() == pytest.approx(eng[0].item() * (1 - 0.05))
    # and neither do the steps its request still runs after it (launched ahead of the host)
    e.update(many, torch.tensor([2, 2]), torch.tensor([0, 0]), width=4)
    assert torch.equal(e.table[0], rows[0])
    assert e.table[1, 0].item() == pytest.approx(rows[1, 0].item() / 4)
    assert e.engine[0].item() == pytest.approx(eng[0].item() * (1 - 0.05) ** 2)
    # until a new request takes the slot (verify counter 0): it starts from the engine row
    new = e.update(many, torch.tensor([0, 3]), torch.tensor([3, 3]), width=4)
    assert new[0, 0].item() == pytest.approx(e.engine[0].item() + 0.5 * (1 - e.engine[0].item()))
    assert e.ended.tolist()[:2] == [0, 0]


def test_a_batch_of_new_requests_starts_from_its_own_first_rate():
    """Fifty new requests verifying at the default rates: after one step the engine row (and
    with it each new row) is their observed rate, not the prior, so the chooser at a CPU's
    batch-50 step times keeps the wide width that their 0.98 acceptance pays for."""
    e = AcceptanceEWMA(slots=51, positions=7, device=torch.device("cpu"))
    acc = torch.tensor([7] * 49 + [0])          # one request rejects its first draft
    cols = e.update(torch.arange(50), torch.zeros(50, dtype=torch.long), acc, width=8)
    assert e.engine[0].item() == pytest.approx((0.8 * 4 + 49) / 54)
    cost = CostTable()
    for w, ms in enumerate([36.2, 111.6, 131.9, 141.1, 168.2, 199.5, 174.6, 202.1], 1):
        cost.measured[(50, w)] = ms / 1e3             # 2-core CPU, demo family, batch 50
    chooser = WidthChooser(range(1, 9), cost)
    chooser.observe(cols[:, :7].tolist(), cols[0, 7:].tolist())
    assert chooser.choose(50) >= 7
    old = AcceptanceEWMA(slots=51, positions=7, device=torch.device("cpu"), engine_prior_n=1e9)
    cols = old.update(torch.arange(50), torch.zeros(50, dtype=torch.long), acc, width=8)
    chooser = WidthChooser(range(1, 9), cost)
    chooser.observe(cols[:, :7].tolist(), cols[0, 7:].tolist())
    assert chooser.choose(50) == 1        # rows started from the prior: held at plain decoding


def test_the_chooser_explores_at_the_widest_width_until_a_step_is_read_back():
    """Before any verify the prior is all the chooser has; at a CPU's batch-50 step times it
    would pick width 1, where nothing is ever measured. So the first steps (those launched
    before the first read-back) run the widest width."""
    cost = CostTable()
    for w, ms in enumerate([36.2, 111.6, 131.9, 141.1, 168.2, 199.5, 174.6, 202.1], 1):
        cost.measured[(50, w)] = ms / 1e3
    chooser = WidthChooser(range(1, 9), cost)
    assert [chooser.choose(50) for _ in range(3)] == [8, 8, 8]
    chooser.observe([[0.8] * 7] * 50)            # the prior itself, read back: width 1 wins
    assert chooser.choose(50) == 1
    forced = WidthChooser(range(1, 9), cost)
    forced.force = iter([3])
    assert forced.choose(50) == 3                # a forced width still rules


def test_chooser_pools_the_rows_with_the_engine_row():
    chooser = WidthChooser(range(1, 7), _cost(6), engine_weight=4.0)
    # one request whose row dipped after a few misses, against a steady engine row
    chooser.observe([[0.0] * 5], engine=[0.9] * 5)
    assert chooser.p == pytest.approx([0.72] * 5)
    assert chooser.choose(16) == 6
    # a full batch outweighs the engine row
    chooser.observe([[0.0] * 5] * 64, engine=[0.9] * 5)
    assert chooser.p[0] == pytest.approx(3.6 / 68) and chooser.choose(16) == 1


# ---- engines --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    ref = Engine(model_path=str(folder), device="cpu").generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return root, folder, [o["output_ids"] for o in ref]


def _engine(root, folder, kind, block, head="vanilla", std=0.05, adaptive=True, **kw):
    cfg = draft_config(kind, hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=block,
                       **({"head_type": head, "sample_from_anchor": True} if kind == "dspark" else {}))
    draft = write_draft(root / f"ad_{kind}_{block}_{head}_{std}", cfg, std=std)
    return Engine(model_path=str(folder), device="cpu", speculative_algorithm=kind.upper(),
                  speculative_draft_model_path=str(draft), speculative_adaptive=adaptive, **kw)


def _widths(outs):
    return [sum(c) for c in zip(*[o["meta_info"]["spec_width_histogram"] for o in outs])]


@pytest.mark.parametrize("kind, block", [("dflash", 5), ("dspark", 4)])
def test_greedy_token_exact_at_random_widths(target, kind, block):
    root, folder, ref = target
    e = _engine(root, folder, kind, block)
    W = e.drafter.width
    assert e.drafter.widths == tuple(range(1, W + 1))
    rng = random.Random(0)
    e.drafter.chooser.force = iter(lambda: rng.randint(1, W), None)
    outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref
    widths = _widths(outs)
    assert all(n > 0 for n in widths), widths                       # every width ran
    for o in outs:
        m = o["meta_info"]
        assert sum(m["spec_width_histogram"]) == m["spec_verify_ct"]


@pytest.mark.parametrize("kind, block", [("dflash", 5), ("dspark", 4)])
def test_greedy_token_exact_with_the_chooser(target, kind, block):
    root, folder, ref = target
    e = _engine(root, folder, kind, block)
    outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref
    assert sum(_widths(outs)) == sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
    # the chooser read the steps' acceptance back: its estimate left the prior
    assert e.drafter.chooser.p != [0.8] * (e.drafter.width - 1)


@pytest.mark.parametrize("kind, block, w", [("dflash", 5, 3), ("dspark", 4, 3)])
def test_a_forced_width_drafts_as_that_fixed_width_does(target, kind, block, w):
    """An adaptive step at width w runs the block of w - 1 drafts that the fixed width w
    (``speculative_num_draft_tokens=w``) runs, with the same draft weights: the same
    proposals, so the same acceptance, not only the same tokens."""
    root, folder, ref = target
    # weights large enough that every mask row of the block moves the drafts before it
    adaptive = _engine(root, folder, kind, block, std=0.3)
    adaptive.drafter.chooser.force = iter(lambda: w, None)
    fixed = _engine(root, folder, kind, block, std=0.3, adaptive=False,
                    speculative_num_draft_tokens=w)
    assert fixed.drafter.widths == (w,)
    # one prompt at a time: in a batch the engines admit differently (the adaptive one
    # reserves room for its widest step), and batch shapes round near-tied drafts apart
    for prompt, want in zip(PROMPTS[:4], ref):
        a, f = (e.generate(input_ids=prompt, sampling_params=GREEDY) for e in (adaptive, fixed))
        assert a["output_ids"] == f["output_ids"] == want
        assert a["meta_info"]["spec_accept_histogram"][:w] == f["meta_info"]["spec_accept_histogram"]
        assert sum(f["meta_info"]["spec_accept_histogram"][1:]) > 0     # some drafts accepted


def test_eager_steps_price_every_width(target, monkeypatch):
    """Without graphs (CPU) the widths' steps are priced from eager steps on dummy rows at the
    batch's eager size before the first choice, so the chooser weighs measured costs, not a
    placeholder shape; the dummy steps leave the requests' outputs as target-only decoding
    gives them."""
    root, folder, ref = target
    timed, measure = [], CostTable.measure

    def record(self, bs, width, *a, **k):
        timed.append((bs, width))
        return measure(self, bs, width, *a, **k)

    monkeypatch.setattr(CostTable, "measure", record)
    e = _engine(root, folder, "dflash", 5, max_running_requests=16)
    d = e.drafter
    assert e.runner.graphs is None and not d.cost.measured
    assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == ref
    # the 16 prompts' batch, then smaller ones as requests finish: each size with every width,
    # three of them timed by an eager step each and the rest interpolated between those
    sizes = {s for s, _ in d.cost.measured}
    assert 16 in sizes and sizes <= {1, 2, 4, 8, 16}
    assert set(d.cost.measured) == {(s, w) for s in sizes for w in d.widths}
    assert all(t > 0 for t in d.cost.measured.values())
    assert sorted(timed) == sorted((s, w) for s in sizes for w in eager_timed_widths(d.widths))
    for s in sizes:
        t2, tw = d.cost.measured[(s, 2)], d.cost.measured[(s, d.width)]
        mid = [d.cost.measured[(s, w)] for w in range(3, d.width)]
        assert mid and all(min(t2, tw) <= t <= max(t2, tw) for t in mid)
    fixed = _engine(root, folder, "dflash", 5, adaptive=False)           # one width: no timing
    fixed.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY)
    assert not fixed.drafter.cost.measured


def test_fixed_width_is_pinned_to_the_maximum(target):
    root, folder, ref = target
    e = _engine(root, folder, "dflash", 4)
    e.drafter.widths = (4,)          # what speculative_adaptive=False builds
    e.drafter.chooser = WidthChooser((4,), e.drafter.cost)
    outs = e.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref[:4]
    assert _widths(outs)[:3] == [0, 0, 0] and _widths(outs)[3] > 0


def test_fixed_width_skips_the_ewma(target, monkeypatch):
    """One candidate width leaves nothing to choose: its steps never run the EWMA update (two
    dozen small kernels a step on a GPU), and still decode exactly."""
    root, folder, ref = target
    e = _engine(root, folder, "dflash", 4, adaptive=False)
    assert e.drafter.ewma is None

    def refuse(*_):
        raise AssertionError("a fixed-width step ran the acceptance EWMA")
    monkeypatch.setattr(AcceptanceEWMA, "update", refuse)
    outs = e.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref[:4]
    assert sum(_widths(outs)) > 0 and e.drafter.chooser.p == [0.8] * 3
    with pytest.raises(RuntimeError, match="ran the acceptance EWMA"):   # adaptive runs it
        _engine(root, folder, "dflash", 4).generate(input_ids=PROMPTS[:1],
                                                    sampling_params=GREEDY)


def test_off_by_default(target):
    root, folder, _ = target
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=4)
    draft = write_draft(root / "ad_default", cfg, std=0.05)
    e = Engine(model_path=str(folder), device="cpu", speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(draft))
    assert e.drafter.widths == (4,) and not e.drafter.adaptive


@pytest.mark.parametrize("kind, block, head", [("dflash", 4, "vanilla"), ("dspark", 3, "gated")])
def test_sampling_is_lossless_at_mixed_widths(target, kind, block, head):
    root, folder, _ = target
    # a prompt and temperature whose second token is far from certain (the verify decides it)
    params = {"max_new_tokens": 2, "temperature": 1.5, "top_k": 6, "ignore_eos": True}
    prompt, n = [2, 9, 4], 12000
    e = _engine(root, folder, kind, block, head, max_running_requests=1000,
                max_total_tokens=1000 * 10)
    W = e.drafter.width
    rng = random.Random(1)
    e.drafter.chooser.force = iter(lambda: rng.randint(1, W), None)
    outs = e.generate(input_ids=[prompt] * n, sampling_params=params)
    widths = _widths(outs)
    assert all(c > 0 for c in widths), widths       # second tokens came from every width
    assert two_token_chi_square_pvalue(e, outs, prompt, params) > 0.01


def test_width_metrics_and_stream_outputs(target):
    pytest.importorskip("prometheus_client")
    from blockspec.engine.loop import StreamOutput
    from blockspec.server.metrics import Metrics, RequestTimer

    m = Metrics(verify_width=4)
    m.observe(RequestTimer(), StreamOutput(rid="a", token_ids=[1, 2, 3], text="", logprobs=[],
                                           meta_info={}, accept_lengths=[1, 2],
                                           verify_widths=[1, 3]))
    assert m.registry.get_sample_value("blockspec_spec_verify_width_count") == 2
    assert m.registry.get_sample_value("blockspec_spec_verify_width_sum") == 4
    assert m.registry.get_sample_value("blockspec_spec_verify_width_bucket", {"le": "1.0"}) == 1
    # the engine loop reports each verify's width with its accept length
    root, folder, _ = target
    e = _engine(root, folder, "dflash", 4)
    e.drafter.chooser.force = itertools.cycle([1, 4])
    outs, done = [], threading.Event()

    def sink(out):
        outs.append(out)
        if out.finished:
            done.set()

    e.submit(PROMPTS[0], SamplingParams.from_dict({**GREEDY, "max_new_tokens": 12}), sink)
    assert done.wait(60)
    seen = [w for o in outs for w in o.verify_widths]
    assert len(seen) == sum(len(o.accept_lengths) for o in outs)
    assert all(a <= w for o in outs for a, w in zip(o.accept_lengths, o.verify_widths))
    assert set(seen) == {1, 4}
    e.shutdown()


@pytest.mark.parametrize("profile", ["0,0,0", "1,1,1"])
def test_bench_reports_widths_and_simulates_at_any_width(profile, monkeypatch):
    """Simulated acceptance at the chosen widths: never accepting drives the chooser to plain
    decoding; always accepting keeps it at the widest verify, each step accepting all w - 1.
    The step costs are a GPU-like table, not the CPU's timings, whose noise between widths
    near a tie (a CPU verify costs about its rows) would make the widest width a coin flip."""
    import argparse

    from blockspec.bench.bench_args import add_arguments
    from blockspec.bench.engine_bench import run

    def measure(self, bs, width, run, device, reps=1, warm=True):
        self.measured[(bs, width)] = _cost(4, bs).measured[(bs, width)]
        return self.measured[(bs, width)]

    monkeypatch.setattr(CostTable, "measure", measure)
    monkeypatch.setattr(CostTable, "observe", lambda *a: None)   # the CPU steps' own times too

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--speculative-adaptive"])
    args.__dict__.update(device="cpu", input_len=4, output_len=120, batch_size=[4], repeats=1,
                         random_draft="dflash", speculative_num_draft_tokens=4,
                         simulate_accept_profile=profile)
    r = run(args)[0]
    assert r["speculative_adaptive"] is True
    hist = r["width_histogram"]
    assert len(hist) == 4 and sum(hist) == sum(r["accept_histogram"])
    assert r["verify_steps_mean"] * 4 == pytest.approx(sum(hist), abs=0.02)
    assert r["verify_steps_max"] >= r["verify_steps_mean"]
    if profile == "0,0,0":
        assert r["accept_histogram"][1:] == [0, 0, 0]
        assert r["verify_steps_mean"] == r["verify_steps_max"] == 119     # a token a step
        assert r["mean_verify_width"] < 1.6 and hist[0] > sum(hist) / 2
    else:
        assert r["mean_verify_width"] > 3.5
        # every step accepted all of its w - 1 drafts, whatever w was
        assert r["accept_histogram"][:3] == hist[:3] and r["accept_histogram"][3] == hist[3]


class _EagerGraphs:
    """A stand-in for ``GraphRunner`` on CPU: 'capture' keeps the step closure and 'replay'
    calls it on the static inputs, so the graph bookkeeping (one graph per width, a step
    launched ahead at another width, the cost table per captured size) runs without CUDA."""

    def __init__(self, max_bs: int) -> None:
        from blockspec.runtime.graph_runner import capture_sizes

        self.sizes, self._graphs, self.replays = capture_sizes(max_bs), {}, set()

    def padded_size(self, bs):
        return next((s for s in self.sizes if s >= bs), None)

    def has(self, key):
        return key in self._graphs

    def capture(self, key, fn):
        fn()
        self._graphs[key] = fn

    def replay(self, key):
        self.replays.add(key)
        return self._graphs[key]()


@pytest.mark.parametrize("kind, block", [("dflash", 5), ("dspark", 4)])
def test_graph_bookkeeping_per_width(target, kind, block, monkeypatch):
    root, folder, ref = target

    def measure(self, bs, width, replay, device, reps=3, warm=True):   # no CUDA clock: fixed
        replay()
        self.measured[(bs, width)] = 1.0 + 0.1 * width + 0.01 * bs * width

    monkeypatch.setattr(CostTable, "measure", measure)
    monkeypatch.setattr(CostTable, "observe", lambda *a: None)   # the CPU steps' own times too
    e = _engine(root, folder, kind, block, max_running_requests=16)
    e.runner.graphs = _EagerGraphs(16)
    e.runner.host_max_seq_len = 512    # the torch backend's context bound (graph steps set none)
    d = e.drafter
    rng = random.Random(0)
    d.chooser.force = iter(lambda: rng.randint(1, d.width), None)
    assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == ref
    assert {k[0] for k in e.runner.graphs.replays} == {f"spec{w}" for w in d.widths}
    assert set(d.cost.measured) == {(s, w) for s in (1, 2, 4, 8, 16) for w in d.widths}
    d.chooser.force = None
    assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == ref


class _ModeGraphs(_EagerGraphs):
    """Records whether autograd was off while each step was captured: a capture with it on
    would record the layers' torch references instead of the kernels."""

    def __init__(self, max_bs: int) -> None:
        super().__init__(max_bs)
        self.grad_at_capture: list[bool] = []

    def capture(self, key, fn):
        self.grad_at_capture.append(torch.is_grad_enabled())
        super().capture(key, fn)


@pytest.mark.parametrize("kind, block", [("dflash", 5), ("dspark", 4)])
def test_graphs_are_captured_without_autograd(target, kind, block, monkeypatch):
    root, folder, ref = target
    monkeypatch.setattr(CostTable, "measure",
                        lambda self, bs, width, replay, device, reps=3, warm=True: replay())
    e = _engine(root, folder, kind, block)
    e.runner.graphs = _ModeGraphs(4)
    e.runner.host_max_seq_len = 512
    assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == ref
    assert e.runner.graphs.grad_at_capture and not any(e.runner.graphs.grad_at_capture)


def test_near_ties_go_to_the_narrower_width_past_batch_1():
    """A wider width must beat a narrower one's expected rate by more than tie_margin when
    requests share the batch; a lone request takes the best."""
    cost = CostTable()
    for bs in (1, 64):    # tau 1.5: width 2 commits 1.5 tokens a step
        cost.measured.update({(bs, 1): 1.0, (bs, 2): 1.49})     # width 2: +0.7 %
    chooser = WidthChooser((1, 2), cost, probe_every=0, blind_margin=0.0)
    chooser.observe([[0.5]])
    assert chooser.choose(1) == 2 and chooser.choose(64) == 1
    cost.measured[(64, 2)] = 1.47                                 # +2 %: a real gain
    assert chooser.choose(64) == 2
    flat = WidthChooser((1, 2), cost, probe_every=0, blind_margin=0.0, tie_margin=0.0)
    flat.observe([[0.5]])
    cost.measured[(64, 2)] = 1.49
    assert flat.choose(64) == 2


def test_tau_15_at_batch_64_holds_plain_decoding():
    """The H100 live table at batch 64, tau 1.5 (widths 1 and 2 within 0.5 %): with the blind
    margin alone the chooser left width 1 whenever it stood there; with the tie margin it
    stays (docs/benchmarks.md: the pinned width 2 ran 4 % slower than width 1)."""
    cost = CostTable()
    cost.measured.update({(64, 1): 9.704e-3, (64, 2): 14.633e-3})
    rows = [[0.5]] * 64
    held = WidthChooser((1, 2), cost, probe_every=0)
    held.observe(rows)
    untied = WidthChooser((1, 2), cost, probe_every=0, tie_margin=0.0)
    untied.observe(rows)
    assert held.choose(64) == 1 and untied.choose(64) == 2
