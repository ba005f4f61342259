"""scripts/tune_w4a16_prefill.py: its sweep enumeration, its validation of each point, and the
table entries it prints (one point is measured for real under the Triton interpreter)."""
import importlib.util
from pathlib import Path

import pytest
import torch

from blockspec.kernels import w4a16_prefill as wp
from blockspec.kernels.triton_loader import triton_available

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "tune_w4a16_prefill.py"
_spec = importlib.util.spec_from_file_location("tune_w4a16_prefill", _PATH)
tune = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tune)


@pytest.mark.parametrize("kind, k", [("grouped", 2688), ("grouped", 1856), ("dense", 3712)])
def test_stage0_is_a_prefill_sweep(kind, k):
    cfgs = tune.stage_configs(kind, k, 0)
    assert len(cfgs) >= 8 and len({tune.config_key(c) for c in cfgs}) == len(cfgs)
    for c in cfgs:
        assert tune.config_problem(c, k) is None and wp.check_prefill_config(c) == c
        assert c["block_m"] in (64, 128) and c["block_n"] in (128, 256)
        assert c["block_k"] == (128 if k % 128 == 0 else 64) and c["num_stages"] == 3
        assert c["n_inner"] == (kind == "grouped")
    assert {c["swap"] for c in cfgs} == {True, False} == {c["x_perm"] for c in cfgs}


def test_stage1_changes_one_option_of_the_best():
    best = tune.stage_configs("grouped", 2688, 0)[0]
    around = tune.stage_configs("grouped", 2688, 1, best)
    assert around and all(sum(c[key] != best[key] for key in best) == 1 for c in around)
    assert {key for c in around for key in c if c[key] != best[key]} >= {
        "num_stages", "block_k", "n_inner", "x_perm"}
    assert tune.stage_configs("grouped", 2688, 1, None) == []


@pytest.mark.parametrize("change, why", [
    ({"block_n": 96}, "powers of two"), ({"block_n": 256, "num_warps": 4}, "accumulators"),
    ({"block_n": 32}, "swap"), ({"num_stages": 8, "block_n": 256}, "shared memory"),
])
def test_config_problem(change, why):
    cfg = {**wp.DEFAULT_PREFILL["grouped"], **change}
    assert why in tune.config_problem(cfg)
    assert tune.config_problem(wp.DEFAULT_PREFILL["grouped"]) is None


def test_x_perm_needs_whole_k_blocks():
    cfg = {**wp.DEFAULT_PREFILL["grouped"], "x_perm": True}
    assert "x_perm" in tune.config_problem(cfg, 1856) and tune.config_problem(cfg, 2688) is None


def _rec(shape, tokens, ms, **cfg):
    kind = "grouped" if shape.startswith("routed") else "dense"
    n, k = {"routed_up": (1856, 2688), "routed_down": (2688, 1856)}.get(shape, (3712, 2688))
    return {"shape": shape, "kind": kind, "n": n, "k": k, "tokens": tokens,
            "rows": tokens * 6, "method": "w4a16", "status": "ok", "ms": ms,
            "tflops": 1.0, "config": {**wp.DEFAULT_PREFILL[kind], **cfg}}


def test_table_entries_pair_down_with_ups_block_m():
    records = [_rec("routed_up", 2048, 1.0, block_m=64), _rec("routed_up", 2048, 1.2),
               _rec("routed_down", 2048, 0.8, block_m=128), _rec("routed_down", 2048, 0.9,
                                                                  block_m=64, block_n=256),
               {**_rec("routed_down", 2048, 0.1, block_m=64), "status": "mismatch"}]
    lines = tune.table_entries(records)
    up = next(line for line in lines if "('grouped', 1856, 2688, 8192)" in line)
    down = next(line for line in lines if "('grouped', 2688, 1856, 8192)" in line)
    assert "'block_m': 64" in up
    assert "'block_m': 64" in down and "'block_n': 256" in down  # not the faster 128-row one
    assert tune.best_of(records, "routed_down", 2048)["ms"] == 0.8  # mismatches never win


@pytest.mark.skipif(not triton_available(), reason="triton not importable")
def test_measure_validates_and_records_failures(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = tune.Problem("routed_up", *tune.SMOKE_SHAPES["routed_up"], 4, torch.device("cpu"), True)
    cfg = tune.stage_configs("grouped", p.k, 0, smoke=True)[0]
    rec = tune.measure(p, "w4a16", cfg, 128, reps=1)
    assert rec["status"] == "ok" and rec["err"] <= tune.TOL and rec["ms"] > 0
    assert rec["rows"] == 256 and rec["tflops"] > 0
    bad = tune.measure(p, "w4a16", {**cfg, "block_n": 96}, 128, reps=1)  # the kernel refuses
    assert bad["status"] == "failed" and "block_n" in bad["error"] and bad["ms"] is None


def test_a_winning_dequant_point_becomes_a_table_entry():
    records = [_rec("shared_down", 8192, 0.9),
               {**_rec("shared_down", 8192, 0.5), "method": "dequant+gemm",
                "config": dict(tune.DEQUANT)}]
    line = next(line for line in tune.table_entries(records) if "dense" in line)
    assert "{'dequant': True}" in line and "0.500 ms" in line
    assert wp.check_prefill_config(tune.DEQUANT) == tune.DEQUANT


@pytest.mark.skipif(not triton_available(), reason="triton not importable")
def test_dequant_point_is_measured_and_checked(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = tune.Problem("routed_down", *tune.SMOKE_SHAPES["routed_down"], 4, torch.device("cpu"),
                     True)
    rec = tune.measure(p, "dequant+gemm", tune.DEQUANT, 128, reps=1)
    assert rec["status"] == "ok" and rec["err"] <= tune.TOL and rec["ms"] > 0


def test_stage1_varies_the_best_tile_even_when_dequant_won():
    args = type("A", (), {"stage": 1, "smoke": False, "tokens": [8192]})()
    records = [_rec(name, 8192, 1.0) for name in tune.SHAPES] + [
        {**_rec(name, 8192, 0.1), "method": "dequant+gemm", "config": dict(tune.DEQUANT)}
        for name in tune.SHAPES]
    points = tune.plan(args, records)
    assert points and all(m == "w4a16" and "block_k" in c for _, m, c, _ in points)
