"""No litter: the demo model is written once, whole, by concurrent first runs; an interrupted
write leaves nothing; quantize never clobbers a folder it was not told to replace."""
from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from blockspec import demo
from blockspec.quant import quantize as q
from blockspec.quant.recipes import QuantizeError

QUANT_FIX = Path(__file__).parent / "fixtures" / "modelopt" / "dense"


# ---- demo model cache -------------------------------------------------------------------------
def _slow_writer(log: Path):
    """A stand-in for write_demo_model (no torch in forked children): slow enough that
    concurrent first runs overlap, and it records which process wrote."""
    def write(folder: Path, seed: int = 0) -> Path:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        (folder / "model.safetensors").write_bytes(b"x" * 1000)
        time.sleep(0.3)
        (folder / "config.json").write_text("{}")
        return folder
    return write


def _first_run(root: str, barrier) -> None:
    barrier.wait()
    demo.ensure_demo_model(Path(root))


def test_concurrent_first_runs_leave_one_clean_demo_model(tmp_path, monkeypatch):
    root, log = tmp_path / "cache", tmp_path / "writes.log"
    (root / "demo-tiny.tmp999-abcdef").mkdir(parents=True)      # left by a killed writer
    monkeypatch.setattr(demo, "write_demo_model", _slow_writer(log))
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_first_run, args=(str(root), barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log.read_text().split()) == 1                        # one process wrote it
    assert sorted(p.name for p in root.iterdir()) == [".demo-tiny.lock", "demo-tiny"]
    assert sorted(p.name for p in (root / "demo-tiny").iterdir()) == ["config.json", "model.safetensors"]


def test_interrupted_demo_write_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(folder: Path, seed: int = 0) -> Path:
        (folder / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "write_demo_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.ensure_demo_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".demo-tiny.lock"]


# ---- quantize ---------------------------------------------------------------------------------
def test_quantize_refuses_a_non_empty_output_unless_overwrite(tmp_path, monkeypatch):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(QuantizeError, match="not empty; pass --overwrite"):
        q.quantize_checkpoint(QUANT_FIX, out, "FP8")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:                 # Ctrl-C mid-write: the old folder stays
        m.setattr(q, "save_tensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            q.quantize_checkpoint(QUANT_FIX, out, "FP8", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["q"] and (out / "keep.txt").is_file()

    q.quantize_checkpoint(QUANT_FIX, out, "FP8", overwrite=True)
    names = {p.name for p in out.iterdir()}
    assert "keep.txt" not in names and {"config.json", "hf_quant_config.json", "model.safetensors"} <= names
    assert [p.name for p in tmp_path.iterdir()] == ["q"]
    with pytest.raises(QuantizeError, match="would overwrite --model-path"):
        q.quantize_checkpoint(QUANT_FIX, QUANT_FIX.parent, "FP8", overwrite=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(QuantizeError, match="is a file"):
        q.quantize_checkpoint(QUANT_FIX, tmp_path / "file", "FP8")
