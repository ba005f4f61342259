"""scripts/confidence_study.py: its traces from a real demo draft, its Brier scores and its
width policies on hand-made traces whose answers are known."""
import importlib.util
from pathlib import Path

import pytest

from blockspec.demo_family import is_shipped

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "confidence_study.py"
_spec = importlib.util.spec_from_file_location("confidence_study", _PATH)
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


@pytest.mark.skipif(not is_shipped(), reason="the demo family is not shipped in this tree")
@pytest.mark.parametrize("member", ["dflash_nvfp4", "dspark_nvfp4"])
def test_record_gives_a_probability_per_draft_and_real_accept_counts(member):
    traces = study.record(member, 2)
    assert len(traces) == 2 and all(traces)
    accepted = [a for tr in traces for a, _ in tr]
    assert all(0 <= a <= 7 for a in accepted) and len(set(accepted)) > 1
    for tr in traces:
        for _, conf in tr:
            assert len(conf) == 7 and all(0.0 < c <= 1.0 for c in conf)


def test_a_confidence_that_knows_the_outcome_scores_zero_and_the_lagged_ones_do_not():
    # each verify's confidences say exactly which drafts pass; the outcomes alternate, so a
    # confidence one step old is always wrong where the two steps differ
    steps = [(7, [1.0] * 7), (0, [0.0] * 7)] * 10
    res = study.predictors([steps], 7)
    assert res["brier"]["confidence_now"] == 0.0
    assert res["brier"]["confidence_lag1"] == 1.0
    assert res["brier"]["confidence_lag2"] == 0.0          # two back: the same phase again
    assert res["rate_by_position"][0] == 0.5


def test_width_policies_on_a_known_trace():
    cost = [1.0, 1.5, 2.0]                    # widths 1..3
    steps = [(2, [0.99, 0.99]), (0, [0.01, 0.01])] * 50
    out = study.throughput([steps], cost, extra_ms=0.0)
    assert out["fixed_w1"] == pytest.approx(1.0, abs=1e-4)
    assert out["fixed_w3"] == pytest.approx((3 + 1) / 2 / 2.0, abs=1e-4)
    # this step's confidence picks w3 for the sure block and w2 (the draft ran) for the other
    assert out["confidence_now_choice"] == pytest.approx((3 + 1) / (2.0 + 1.5), abs=1e-4)
    assert out["confidence_now_choice"] > max(v for k, v in out.items() if k.startswith("fixed"))
