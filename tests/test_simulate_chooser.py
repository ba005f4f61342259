"""scripts/simulate_chooser.py: the real chooser and EWMA on a step table and a simulated
acceptance profile; the answers it must give where the best width is plain."""
import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "simulate_chooser.py"
_spec = importlib.util.spec_from_file_location("simulate_chooser", _PATH)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

TABLE = [1.0, 1.2, 1.3, 1.4]            # widths 1..4


def test_sure_drafts_settle_on_the_widest_verify():
    r = sim.simulate([1.0, 1.0, 1.0], batch=4, cost_ms=TABLE, steps=400)
    assert r["best_fixed"] == 4 and r["x_best_fixed"] > 0.98
    assert r["width_histogram"][3] > 0.9 * sum(r["width_histogram"])


def test_warm_up_steps_are_run_but_not_scored():
    # 100 pinned width-1 steps first: the scored 200 still settle on the widest verify
    r = sim.simulate([1.0, 1.0, 1.0], batch=4, cost_ms=TABLE, steps=200, warm=(1,))
    assert sum(r["width_histogram"]) == 200 and r["width_histogram"][0] < 20
    assert r["best_fixed"] == 4 and r["x_best_fixed"] > 0.95


def test_drafts_that_never_pass_fall_back_to_plain_decoding():
    # the engine row's prior (0.8) and the chooser's margin on width 1 give way in ~30 steps
    r = sim.simulate([0.0, 0.0, 0.0], batch=4, cost_ms=TABLE, steps=800)
    assert r["best_fixed"] == 1 and r["x_width1"] == r["x_best_fixed"] > 0.95
    assert r["width_histogram"][0] > 0.9 * sum(r["width_histogram"])


def test_low_phases_change_the_fixed_widths_score():
    calm = sim.simulate([0.9] * 3, batch=2, cost_ms=TABLE, steps=300, seed=1)
    rough = sim.simulate([0.9] * 3, batch=2, cost_ms=TABLE, steps=300, seed=1,
                         phases=(8, 4, 0.0))
    assert rough["best_fixed_tok_per_ms"] < calm["best_fixed_tok_per_ms"]


def test_a_batch_that_finishes_together_pays_its_slowest_request():
    # sure drafts at width 4 commit 4 tokens a step: 40 tokens are 10 steps of 1.4 ms
    tables = {1: [0.5, 0.6, 0.7, 0.8], 4: TABLE}
    assert abs(sim.finish_together([1.0] * 3, 4, tables, tokens=40, width=4) - 14.0) < 1e-9
    # coins that never pass at width 2: every request commits 1 token a step, 10 steps of 1.2
    assert abs(sim.finish_together([0.0] * 3, 4, tables, tokens=10, width=2) - 12.0) < 1e-9
    # half the drafts pass: requests finish apart, and the last one runs alone on the size-1
    # table (the same coins: a table of one size only is dearer by the tail steps alone)
    ms = sim.finish_together([0.5] * 3, 4, tables, tokens=40, width=4, seed=3)
    flat = sim.finish_together([0.5] * 3, 4, {4: TABLE}, tokens=40, width=4, seed=3)
    tail_steps = (flat - ms) / (1.4 - 0.8)
    assert tail_steps >= 1 and abs(tail_steps - round(tail_steps)) < 1e-9


def test_finish_together_scores_the_chooser_against_every_fixed_width():
    tables = {1: [0.5, 0.6, 0.7, 0.8], 4: TABLE}
    sure = sim.score_finish_together("1.0,1.0,1.0", 4, tables, tokens=64, seeds=3,
                                     warm=(None,))
    assert sure["best_fixed"] == 4 and sure["x_best_fixed"] > 0.97
    never = sim.score_finish_together("0,0,0", 4, tables, tokens=64, seeds=3,
                                      warm=(2, None))
    assert never["best_fixed"] == 1 and never["x_best_fixed"] > 0.9
    assert never["warm"] == [2, "a"]


def test_every_device_table_holds_widths_1_to_8_at_the_bench_sizes():
    # finish_together reads the table of the smallest size that holds the live requests, so a
    # missing size or width would silently price steps from another one
    for name, tables in sim.DEVICE_TABLES.items():
        assert sorted(tables) == [1, 4, 16, 64, 128], name
        for size, row in tables.items():
            assert len(row) == 8 and all(ms > 0 for ms in row), (name, size)
            assert row[0] == min(row), (name, size)     # width 1 verifies nothing: cheapest
