"""The ITL-under-prefill benchmark: its gap bookkeeping, and one tiny CPU run whose rows see
the long prompt's prefill chunks between the streams' tokens (speed is never asserted)."""
from __future__ import annotations


import pytest

from blockspec.bench.itl_bench import gaps, run, summary
from tests.bench_fixtures import bench_args as _args



def test_gaps_are_per_token_and_bounded_by_their_end():
    ev = [(0.0, 1), (1.0, 1), (3.0, 2), (4.0, 1)]
    assert gaps(ev, 0.0, 4.0) == [1.0, 1.0, 1.0]          # the 2-token output: 2 s / 2
    assert gaps(ev, 1.0, 3.0) == [1.0]                    # only the gap ending at 3.0
    s = summary([0.001, 0.002, 0.003])
    assert s["n"] == 3 and s["p50_ms"] == pytest.approx(2.0) and s["max_ms"] == pytest.approx(3.0)


def test_long_prefill_shows_in_the_running_streams():
    """Two decoding-chunk sizes on one engine: a 384-token prompt in 6 chunks of 64 (capped
    by --chunked-prefill-size) and in 12 of 32, each alternating with the streams' steps."""
    ns = _args(["--itl-under-prefill", "--batch-size", "2", "--input-len", "384",
                "--output-len", "400", "--chunked-prefill-size", "64",
                "--decoding-prefill-chunk-size", "128,32", "--device", "cpu", "--dtype", "float32"])
    rows = run(ns)
    assert [r["decoding_prefill_chunk_size"] for r in rows] == [64, 32]
    for r, chunks in zip(rows, (6, 12)):
        assert r["streams"] == 2 and r["input_len"] == 384 and r["chunked_prefill_size"] == 64
        assert r["steady_itl"]["n"] >= 2 * 40
        # each stream decodes a step between every two chunks
        assert r["during_prefill_itl"]["n"] >= 2 * (chunks - 1)
        assert r["long_ttft_s"] > 0
        assert r["p99_during_over_steady_p50"] == pytest.approx(
            r["during_prefill_itl"]["p99_ms"] / r["steady_itl"]["p50_ms"])


@pytest.mark.parametrize("argv, match", [
    (["--batch-size", "2,4", "--input-len", "64"], "one --batch-size"),
    (["--batch-size", "2", "--input-len", "64,128"], "one --batch-size"),
])
def test_one_shape_per_run(argv, match):
    with pytest.raises(ValueError, match=match):
        run(_args(["--itl-under-prefill", "--device", "cpu", *argv]))
