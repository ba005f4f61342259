"""The prefix cache bench runs both workloads with the cache on and off on the tiny preset:
the cache-on rows show hits, the cache-off rows none, and greedy outputs agree (speed itself
is never asserted)."""
from __future__ import annotations

import argparse

import pytest

from blockspec.bench.prefix_bench import run, user_len
from blockspec.cli import main as cli_main
from tests.bench_fixtures import bench_args

# snapshots enough that nothing is evicted: which checkpoint an LRU eviction drops depends on
# which requests finish in one step, so with a small pool the hits would vary run to run
# (eviction itself is tested in test_prefix_cache.py)
TINY = ["--prefix-cache", "--device", "cpu", "--dtype", "float32", "--page-size", "16",
        "--mamba-track-interval", "32", "--mamba-cache-slots", "128", "--output-len", "8"]


def _args(argv: list[str]) -> argparse.Namespace:
    return bench_args(TINY + argv)


def _split(rows: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    on = [r for r in rows if r.get("radix_cache") is True]
    off = [r for r in rows if r.get("radix_cache") is False]
    ratios = [r for r in rows if "ratio" in r]
    return on, off, ratios


@pytest.fixture(scope="module")
def multi_rows():
    return run(_args(["--workload", "multi-turn", "--batch-size", "1,2", "--input-len", "256",
                      "--turns", "3"]))


@pytest.fixture(scope="module")
def agent_rows():
    # prefill chunks of 64 end at the shared prefix (256), where its Mamba state is saved
    return run(_args(["--workload", "agentic", "--input-len", "256", "--suffix-len", "32",
                      "--num-requests", "4", "--concurrency", "1,2",
                      "--chunked-prefill-size", "64"]))


def test_multi_turn_hits_and_matches(multi_rows):
    on, off, ratios = _split(multi_rows)
    assert [r["batch_size"] for r in on] == [1, 2] == [r["batch_size"] for r in off]
    assert len(ratios) == 2
    ulen = user_len(256, 3, 8)
    for w, wo in zip(on, off):
        for key in ("ttft_s_per_turn", "last_turn_ttft_s", "wall_s", "cached_tokens_per_turn",
                    "prompt_len_per_turn"):
            assert key in w and key in wo
        assert w["prompt_len_per_turn"] == wo["prompt_len_per_turn"] == [ulen, 2 * ulen + 8, 256]
        assert len(w["ttft_s_per_turn"]) == 3 and w["last_turn_ttft_s"] > 0
        assert w["cached_tokens_per_turn"][0] == 0
        # each later turn resumes at least at the previous turn's prompt (page aligned)
        assert all(c >= p // 16 * 16 > 0 for c, p in zip(w["cached_tokens_per_turn"][1:],
                                                         w["prompt_len_per_turn"][:-1]))
        assert wo["cached_tokens_per_turn"] == [0, 0, 0]
        assert wo["outputs_match"] is True
    for r in ratios:
        assert r["outputs_match"] is True and r["last_turn_ttft_ratio"] > 0
        assert len(r["ttft_ratio_per_turn"]) == 3


def test_agentic_hits_and_matches(agent_rows):
    on, off, ratios = _split(agent_rows)
    assert [r["concurrency"] for r in on] == [1, 2] == [r["concurrency"] for r in off]
    for w, wo in zip(on, off):
        for key in ("request_time_s", "mean_ttft_s", "wall_s", "cached_tokens"):
            assert key in w and key in wo
        t = w["request_time_s"]
        assert 0 < t["p50"] <= t["p99"] and t["mean"] > 0
        assert w["cached_tokens_per_request"][0] == 0      # the first one fills the cache
        assert w["cached_tokens"] > 0 and w["cached_tokens_per_request"][1] == 256
        assert wo["cached_tokens"] == 0
        assert wo["outputs_match"] is True
    assert all(r["outputs_match"] and r["mean_request_time_ratio"] > 0 for r in ratios)


@pytest.mark.parametrize("other", ["--prefill", "--itl-under-prefill"])
def test_cli_rejects_two_benchmarks(other, capsys):
    assert cli_main(["bench", "--prefix-cache", other]) == 2
    assert "separate benchmarks" in capsys.readouterr().err
