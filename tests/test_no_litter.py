"""No litter: concurrent first runs without --model-path answer from the demo family shipped in
the package and write nothing (no cache, nothing in the home folder, the family untouched);
quantize never clobbers a folder it was not told to replace."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockspec.demo_family import EXAMPLE_QUESTION, FAMILY_DIR
from blockspec.quant import quantize as q
from blockspec.quant.recipes import QuantizeError

QUANT_FIX = Path(__file__).parent / "fixtures" / "modelopt" / "dense"


# ---- first runs -------------------------------------------------------------------------------
def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if "__pycache__" not in p.parts}


def test_concurrent_first_runs_write_nothing(tmp_path):
    cache, home = tmp_path / "cache", tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "BLOCKSPEC_CACHE": str(cache), "HOME": str(home),
           "XDG_CACHE_HOME": str(home / ".cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    before = _snapshot(FAMILY_DIR)
    procs = [subprocess.Popen([sys.executable, "-m", "blockspec", "generate", EXAMPLE_QUESTION,
                               "--device", "cpu", "--max-new-tokens", "80"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=tmp_path / "home")
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    assert all(out.rstrip().endswith("#### 147") for out, _ in outs), outs
    assert all("DFLASH accept length" in err for _, err in outs), outs
    assert not cache.exists() and not list(home.iterdir())
    assert _snapshot(FAMILY_DIR) == before


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
