"""The adaptive width's cost table follows the steps the engine runs: a start-up table that
misprices the live batch (its dummy rows share one slot at context 0) is corrected by the
steps' own times, for the widths that ran and, by the size's ratio, for the others."""
from __future__ import annotations

import itertools

import pytest

from blockspec.speculative.adaptive import CostTable, WidthChooser
from tests.test_adaptive_width import GREEDY, PROMPTS, _engine, target  # noqa: F401

PUBLISHED = (0.9274, 0.8674, 0.8074, 0.7474, 0.6874, 0.6274, 0.5674)   # dflash-published


def test_live_times_replace_the_startup_times():
    cost = CostTable(live_alpha=0.1)
    cost.measured.update({(16, 1): 1.0, (16, 2): 2.0, (16, 3): 4.0})
    cost.observe(10, 2, 1.0)                 # batch 10 reads size 16's entries
    # the start-up time counts as one run: the mean of 2.0 and 1.0
    assert cost.time(16, 2) == pytest.approx(1.5) and cost.time(10, 2) == pytest.approx(1.5)
    # widths not run take their start-up time times the size's live / start-up ratio
    assert cost.time(16, 3) == pytest.approx(4.0 * 0.75)
    for _ in range(200):                     # then an EWMA: it reaches a steady value
        cost.observe(16, 2, 1.0)
    assert cost.time(16, 2) == pytest.approx(1.0, rel=1e-6)
    assert cost.time(16, 3) == pytest.approx(2.0, rel=1e-6)
    assert cost.startup(16, 2) == 2.0        # the start-up figure is kept apart
    for _ in range(30):                      # a later change is followed at the EWMA's pace
        cost.observe(16, 2, 3.0)
    assert 2.9 < cost.time(16, 2) < 3.0


def test_analytic_entries_take_the_first_time_as_it_is():
    """Without a start-up measurement (tensor parallelism without graphs) the analytic shape
    is in relative units: the first live time replaces it, and scales the other widths."""
    cost = CostTable()
    cost.observe(4, 2, 0.003)
    assert cost.time(4, 2) == pytest.approx(0.003)
    ratio = 0.003 / CostTable.analytic(4, 2)
    assert cost.time(4, 5) == pytest.approx(CostTable.analytic(4, 5) * ratio)


def test_the_chooser_leaves_a_width_the_startup_table_overpriced():
    """The batch-16 case measured on the H200: the start-up table put width 5 at 9.9 ms and
    width 4 at 8.6, while the engine's own steps ran width 4 at 8.9 and width 5 at 8.5. The
    chooser starts at width 4; its steps' times and the probes of width 5 move it there."""
    cost = CostTable()
    startup = [5.711, 7.437, 8.372, 8.556, 9.905, 10.667, 12.015, 12.254]
    live = {1: 5.7, 2: 6.9, 3: 7.45, 4: 8.9, 5: 8.47, 6: 9.6, 7: 10.5, 8: 11.0}
    for w, ms in enumerate(startup, 1):
        cost.measured[(16, w)] = ms / 1e3
    chooser = WidthChooser(range(1, 9), cost)
    chooser.observe([list(PUBLISHED)])          # a read-back row at the published profile
    assert chooser.choose(16) == 4
    picks = []
    for _ in range(400):
        w = chooser.choose(16)
        cost.observe(16, w, live[w] / 1e3)
        picks.append(w)
    assert picks[-100:].count(5) >= 90, picks[-100:]


def test_engine_steps_are_timed_into_the_table(target):  # noqa: F811
    """An adaptive engine times every step it runs (CPU: the eager call) and the table's
    live entries are those of the widths that ran; a fixed width times nothing."""
    root, folder, ref = target
    e = _engine(root, folder, "dflash", 5)
    d = e.drafter
    assert e.runner.time_steps
    d.chooser.force = itertools.cycle([1, 3])
    outs = e.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref[:2]
    assert {w for _, w in d.cost.live} == {1, 3}
    assert all(t > 0 for t in d.cost.live.values())
    # the widths that did not run share their size's live / start-up ratio
    for s, _ in d.cost.live:
        ratios = [d.cost.time(s, w) / d.cost.startup(s, w) for w in (2, 4, 5)]
        assert ratios == pytest.approx([ratios[0]] * 3) and ratios[0] != 1.0   # scaled
    fixed = _engine(root, folder, "dflash", 5, adaptive=False)
    assert not fixed.runner.time_steps
    fixed.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    assert not fixed.drafter.cost.live
