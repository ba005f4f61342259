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
