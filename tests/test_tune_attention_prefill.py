"""The attention prefill sweep's smoke run on the CPU (Triton's interpreter): every candidate
it times matches the current config's output, and it names a config to paste."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_smoke_sweep_checks_times_and_names_a_config(tmp_path):
    out = tmp_path / "attn.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune_attention_prefill.py"),
                          "--smoke", "--reps", "1", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 36 and all(r["status"] == "ok" and r["err"] < 1e-4 for r in recs)
    assert {r["block_n"] for r in recs} == {32, 64, 128}
    line = next(x for x in res.stdout.splitlines() if x.startswith("PREFILL_CONFIG = "))
    cfg = json.loads(line.split("= ", 1)[1].split(" #")[0])
    assert set(cfg) == {"block_m", "block_n", "num_warps", "num_stages", "full_blocks"}
