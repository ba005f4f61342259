"""The benchmark harness runs and reports self-consistent figures (speed is never asserted)."""
from __future__ import annotations

import argparse

from blockspec.bench.engine_bench import add_arguments, run, step_weight_bytes


def _args(**kw):
    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args([])
    ns.__dict__.update(kw)
    return ns


def test_bench_reports_consistent_numbers():
    r = run(_args(device="cpu", input_len=8, output_len=6, batch_size=2, repeats=1))
    assert r["decode_tok_per_s"] > 0 and r["step_ms"] > 0
    assert r["achieved_GBps"] * 1e9 * r["step_ms"] / 1e3 == __import__("pytest").approx(
        r["weight_bytes_per_step"], rel=1e-2)


def test_expert_bytes_follow_touched_experts(tmp_path):
    from blockspec.demo import write_demo_model
    from blockspec.engine import Engine

    e = Engine(model_path=str(write_demo_model(tmp_path / "m")), device="cpu")
    one, many = step_weight_bytes(e.model, 1), step_weight_bytes(e.model, 64)
    expert = sum(t.numel() * t.element_size() for n, t in e.model.state_dict().items() if ".experts." in n)
    emb_row = e.config.hidden_size * 4
    # 4 experts, top-2: one token touches half the expert bytes, 64 tokens nearly all; the
    # embedding lookup reads one row per token
    want = expert * (1 - 0.5 ** 64) - expert * 0.5 + 63 * emb_row
    assert many - one == __import__("pytest").approx(want, rel=1e-6)
