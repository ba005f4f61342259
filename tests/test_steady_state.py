"""``blockspec bench --steady-state``: R x B requests with at most B running, each replaced as
it finishes, lengths spread so the batch does not finish in waves."""
from __future__ import annotations

import pytest

from blockspec.bench.engine_bench import build_engine, run, steady_row
from blockspec.bench.steady_state import steady_workload
from tests.bench_fixtures import bench_args


def test_workload_is_seeded_by_batch_and_spreads_the_lengths():
    prompts, lens = steady_workload(4, 5, 6, 40, 1000)
    assert len(prompts) == len(lens) == 20 and all(len(p) == 6 for p in prompts)
    assert all(20 <= n <= 60 for n in lens) and len(set(lens)) > 5
    assert steady_workload(4, 5, 6, 40, 1000) == (prompts, lens)
    assert steady_workload(8, 5, 6, 40, 1000)[0][:4] != prompts[:4]


@pytest.mark.parametrize("draft", [None, "dflash"])
def test_the_batch_stays_full_and_never_exceeds_its_size(draft):
    """Every engine step runs at most 2 requests (the slots hold 4), exactly 2 while more
    wait, and all 8 requests finish; the cap is lifted afterwards."""
    spec = dict(random_draft=draft, speculative_num_draft_tokens=3,
                simulate_accept_length=2.0) if draft else {}
    args = bench_args(device="cpu", input_len=4, output_len=10, steady_state=4, repeats=1, **spec)
    engine, _ = build_engine(args, 4)
    try:
        sched, seen = engine.scheduler, []
        admit = sched._admit

        def admitted():               # each step admits before it runs: (in the engine, waiting)
            admit()
            seen.append((len(sched.running) + len(sched.prefilling), len(sched.waiting)))

        sched._admit = admitted
        row = steady_row(engine, 2, args)
        assert max(n for n, _ in seen) == 2
        assert all(n == 2 for n, waiting in seen if waiting)      # replaced at once
        assert row["steady_state_requests"] == 8 and row["batch_size"] == 2
        assert row["decode_tok_per_s"] > 0 and 5 <= row["mean_output_len"] <= 15
        assert sched.max_running is None
        if draft:
            assert row["accept_length"] == pytest.approx(2.0, rel=0.15)
    finally:
        engine.shutdown()


def test_flag_is_checked_and_rows_carry_it():
    with pytest.raises(ValueError, match="--steady-state takes the rounds"):
        run(bench_args(device="cpu", input_len=4, output_len=4, repeats=1, steady_state=0))
    rows = run(bench_args(device="cpu", input_len=4, output_len=6, repeats=1, steady_state=2,
                          batch_size=[1, 2]))
    assert [r["steady_state_requests"] for r in rows] == [2, 4]
