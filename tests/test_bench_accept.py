"""Simulated acceptance profiles of ``blockspec bench``: the flags' parsing, the named profiles'
means, and the realised per-position rates of a tiny CPU run against the profile (and its
low-acceptance phases) within statistical tolerance."""
from __future__ import annotations

import argparse
import itertools
import math

import pytest
import torch

from blockspec.bench import accept_profile as ap
from blockspec.bench.engine_bench import build_engine, run
from blockspec.speculative.simulated_accept import SimulatedAcceptance
from tests.bench_fixtures import bench_args as _args



@pytest.mark.parametrize("text, want", [
    ("0.85,0.75,0.65,0.55,0.45,0.35,0.30", (None, (0.85, 0.75, 0.65, 0.55, 0.45, 0.35, 0.30))),
    (" 1, 0.5 ,0", (None, (1.0, 0.5, 0.0))),
    ("dflash-published", ("dflash-published", ap.NAMED_PROFILES["dflash-published"])),
])
def test_profile_parser_accepts_lists_and_names(text, want):
    assert ap.parse_profile(text) == want


@pytest.mark.parametrize("text, why", [
    ("0.9,x", "comma list"), ("", "comma list"), ("0.9,,0.5", "comma list"),
    ("1.2,0.5", r"in \[0, 1\]"), ("0.5,-0.1", r"in \[0, 1\]"), ("nan", r"in \[0, 1\]"),
    ("dflash-unpublished", "comma list"),
])
def test_profile_parser_refuses_bad_specs_naming_the_flag(text, why):
    with pytest.raises(ValueError, match="--simulate-accept-profile") as e:
        ap.parse_profile(text)
    assert e.match(why)


def test_phases_parser_good_and_bad():
    assert ap.parse_phases("every=64,len=32,scale=0.3") == ap.LowAcceptPhases(64, 32, 0.3)
    assert ap.parse_phases(" scale=0 , every=8,len=1") == ap.LowAcceptPhases(8, 1, 0.0)
    for bad, why in [("every=64,len=32", "missing scale"), ("every=64,len=64,scale=0.3", "len must"),
                     ("every=64,len=0,scale=0.3", "len must"), ("every=8,len=2,scale=1.5", "scale must"),
                     ("every=8,len=2,scale=0.5,x=1", "expected"), ("every=8,every=9,len=2,scale=.5",
                                                                   "each once"),
                     ("every=eight,len=2,scale=0.5", "integers"), ("64,32,0.3", "expected")]:
        with pytest.raises(ValueError, match="--simulate-low-accept-phases") as e:
            ap.parse_phases(bad)
        assert e.match(why), bad


def test_low_steps_counts_the_last_len_of_each_period():
    ph = ap.LowAcceptPhases(every=4, length=2, scale=0.5)
    low = [n for n in range(12) if n % 4 >= 2]          # the rule SimulatedAcceptance applies
    assert [ph.low_steps(n) for n in range(13)] == [sum(1 for k in low if k < n) for n in range(13)]


def test_named_profiles_reproduce_the_figures_they_stand_for():
    """dflash-published gives the 4.2 used for DFlash at width 6 (5 drafts); dspark-published
    3.7 at width 4; the measured demo profiles give the eval's measured accept lengths."""
    def m(name: str, gamma: int) -> float:
        return ap.mean_accept_length(ap.NAMED_PROFILES[name], gamma)

    assert m("dflash-published", 5) == pytest.approx(4.2, abs=0.005)
    assert m("dflash-published", 6) == pytest.approx(4.41, abs=0.005)    # width 7, as documented
    assert m("dspark-published", 3) == pytest.approx(3.7, abs=0.005)
    assert m("demo-measured", 7) == pytest.approx(7.469, abs=0.01)
    assert m("demo-nvfp4-measured", 7) == pytest.approx(4.473, abs=0.01)
    for probs in ap.NAMED_PROFILES.values():           # decaying or measured, all 7 long
        assert len(probs) == 7 and all(0 < p < 1 for p in probs)
    p = ap.NAMED_PROFILES["dflash-published"]
    assert all(a > b for a, b in itertools.pairwise(p))


def test_accept_length_is_the_step_profile_of_floor_and_ceil():
    assert ap.accept_length_profile(2.6, 3) == pytest.approx((1.0, 0.6, 0.0))
    assert ap.mean_accept_length(ap.accept_length_profile(3.7, 3), 3) == pytest.approx(3.7)
    assert ap.accept_length_profile(4.0, 3) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"--simulate-accept-length must be in \[1, 4\]"):
        ap.accept_length_profile(4.5, 3)


def test_simulated_acceptance_realises_conditional_rates_on_the_device():
    """Many coins at once: P(draft i | drafts < i) comes out at the profile; a low phase scales
    every probability on the steps it covers and only those."""
    probs = (0.9, 0.6, 0.3)
    g = torch.Generator().manual_seed(0)
    n = 40000
    coins = torch.rand(n, 3, generator=g, dtype=torch.float64)
    acc = SimulatedAcceptance(probs, "cpu").accepted(coins, torch.zeros(n, dtype=torch.int64))
    hist = torch.bincount(acc, minlength=4).tolist()
    for got, p in zip(ap.histogram_rates(hist), probs):
        assert got == pytest.approx(p, abs=0.015)
    ctr = torch.arange(n) % 8                            # every=8, len=3: steps 5, 6, 7 low
    acc = SimulatedAcceptance(probs, "cpu", every=8, low_len=3, low_scale=0.5).accepted(coins, ctr)
    low = ctr >= 5
    for rows, scale in ((low, 0.5), (~low, 1.0)):
        hist = torch.bincount(acc[rows], minlength=4).tolist()
        for got, p in zip(ap.histogram_rates(hist), probs):
            assert got == pytest.approx(p * scale, abs=0.03)


def test_contradictory_or_orphan_flags_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match="--simulate-accept-profile and --simulate-accept-length"):
        run(_args(device="cpu", random_draft="dflash", simulate_accept_profile="0.9,0.8,0.7",
                  simulate_accept_length=2.0, repeats=1))
    with pytest.raises(ValueError, match="--simulate-low-accept-phases scales .*--simulate-accept-profile"):
        run(_args(device="cpu", random_draft="dflash", simulate_low_accept_phases="every=4,len=2,scale=.5",
                  repeats=1))
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    with pytest.raises(ValueError, match="--simulate-accept-profile cannot be combined with --json-schema"):
        run(_args(device="cpu", random_draft="dflash", simulate_accept_profile="dflash-published",
                  json_schema=str(schema), repeats=1))
    with pytest.raises(ValueError, match="--simulate-low-accept-phases"):      # malformed, early
        run(_args(device="cpu", random_draft="dflash", simulate_accept_profile="0.9,0.8,0.7",
                  simulate_low_accept_phases="every=4", repeats=1))


def test_profile_must_cover_the_verify_block_and_needs_a_draft():
    with pytest.raises(ValueError, match="--simulate-accept-profile gives 2 positions.*3 drafts"):
        run(_args(device="cpu", input_len=4, output_len=4, repeats=1, random_draft="dflash",
                  speculative_num_draft_tokens=4, simulate_accept_profile="0.9,0.8"))
    with pytest.raises(ValueError, match="--simulate-accept-profile needs a draft"):
        run(_args(device="cpu", input_len=4, output_len=4, repeats=1,
                  simulate_accept_profile="0.9,0.8"))


def _within_tolerance(row: dict, want: list[float]) -> None:
    """Each realised conditional rate within 4 standard errors (+0.01) of ``want``."""
    hist = row["accept_histogram"]
    at_least = [sum(hist[k:]) for k in range(len(hist))]
    assert sum(hist) > 100                              # enough verifies to mean something
    for k, (got, p) in enumerate(zip(row["accept_rates"], want), start=1):
        n = at_least[k - 1]
        tol = 4 * math.sqrt(max(p * (1 - p), 1e-4) / n) + 0.01
        assert abs(got - p) <= tol, (k, got, p, n)


def test_bench_realises_a_profile_per_position():
    rows = run(_args(device="cpu", input_len=4, output_len=120, batch_size=[4], repeats=1,
                     random_draft="dflash", speculative_num_draft_tokens=4,
                     simulate_accept_profile="0.9,0.6,0.3,0.2"))
    r = rows[0]
    assert r["simulated_accept_profile"] == [0.9, 0.6, 0.3, 0.2]
    assert r["simulated_profile_accept_length"] == pytest.approx(1 + 0.9 + 0.54 + 0.162, abs=1e-4)
    assert r["simulated_expected_rates"] == pytest.approx([0.9, 0.6, 0.3])
    _within_tolerance(r, [0.9, 0.6, 0.3])
    assert r["accept_length"] == pytest.approx(r["simulated_profile_accept_length"], rel=0.1)


def test_low_acceptance_phases_show_in_the_realised_rates():
    """Profile 1,1,1 accepts everything; the last 2 of every 4 steps halve each probability:
    position 1's rate falls to the steps' mix (about 0.75), as the phases predict."""
    rows = run(_args(device="cpu", input_len=4, output_len=120, batch_size=[4], repeats=1,
                     random_draft="dspark", speculative_num_draft_tokens=4,
                     simulate_accept_profile="1,1,1",
                     simulate_low_accept_phases="every=4,len=2,scale=0.5"))
    r = rows[0]
    assert r["simulated_low_accept_phases"] == {"every": 4, "len": 2, "scale": 0.5}
    assert r["simulated_low_phase_steps"] > 0
    assert 0.6 < r["accept_rates"][0] < 0.9
    _within_tolerance(r, r["simulated_expected_rates"])
    assert r["accept_length"] == pytest.approx(r["simulated_expected_accept_length"], rel=0.1)


def test_accept_length_shorthand_runs_as_its_step_profile():
    """--simulate-accept-length 2.6 at width 4 is the profile 1, 0.6, 0: every verify accepts
    1 or 2 drafts, never 0 or 3, and the row names the profile it ran."""
    rows = run(_args(device="cpu", input_len=4, output_len=60, batch_size=[2], repeats=1,
                     random_draft="dflash", speculative_num_draft_tokens=4,
                     simulate_accept_length=2.6))
    r = rows[0]
    assert r["simulated_accept_length"] == 2.6
    assert r["simulated_accept_profile"] == pytest.approx([1.0, 0.6, 0.0])
    hist = r["accept_histogram"]
    assert hist[0] == 0 and hist[3] == 0 and hist[1] > 0 and hist[2] > 0
    assert r["accept_rates"][0] == 1.0 and r["accept_rates"][2] == 0.0


def test_every_bench_checks_the_simulation_flags_before_building():
    """``build_engine`` (every bench's) refuses contradictory flags before it builds anything:
    the namespace carries nothing else it could build from."""
    ns = argparse.Namespace(simulate_accept_profile="dflash-published", simulate_accept_length=3.0,
                            simulate_low_accept_phases=None, json_schema=None)
    with pytest.raises(ValueError, match="contradict"):
        build_engine(ns, 1)


def test_fixed_widths_pin_the_adaptive_engine_and_expected_rate_follows_the_widths():
    """``--fixed-widths 1,3`` adds a row per width before the adaptive row, each run wholly at
    its width (width 1 accepts nothing); ``expected_decode_tok_per_s`` is the profile's mean
    at the widths the steps ran over the same decode time, so it tracks the realised rate."""
    rows = run(_args(device="cpu", input_len=4, output_len=60, batch_size=[2], repeats=1,
                     random_draft="dflash", speculative_num_draft_tokens=4,
                     speculative_adaptive=True, fixed_widths=[1, 3],
                     simulate_accept_profile="0.9,0.6,0.3"))
    assert [r["pinned_width"] for r in rows] == [1, 3, None]
    one, three, adaptive = rows
    assert one["width_histogram"][0] > 0 and sum(one["width_histogram"][1:]) == 0
    assert one["accept_length"] == 1.0 and one["verify_width"] == 1
    assert three["width_histogram"][2] == sum(three["width_histogram"])
    for r, mean in ((one, 1.0), (three, 1 + 0.9 + 0.54)):
        steps = sum(r["width_histogram"])
        want = steps * mean / r["decode_s"]
        assert r["expected_decode_tok_per_s"] == pytest.approx(want, rel=1e-3)
    assert adaptive["verify_width"] == 4 and adaptive["expected_decode_tok_per_s"] > 0
    assert three["expected_decode_tok_per_s"] == pytest.approx(three["decode_tok_per_s"], rel=0.25)


def test_fixed_widths_need_an_adaptive_engine_and_candidate_widths():
    base = dict(device="cpu", input_len=4, output_len=8, batch_size=[1], repeats=1,
                random_draft="dflash", speculative_num_draft_tokens=4)
    with pytest.raises(ValueError, match="--speculative-adaptive"):
        run(_args(**base, fixed_widths=[2]))
    with pytest.raises(ValueError, match="--fixed-widths 6: not a candidate"):
        run(_args(**base, speculative_adaptive=True, fixed_widths=[2, 6]))
