"""scripts/adaptive_table.py: the adaptive row against its pinned rows, and the flag on an
adaptive row whose live steps left its pinned rows' cost behind."""
import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "adaptive_table.py"
_spec = importlib.util.spec_from_file_location("adaptive_table", _PATH)
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


def _row(pinned, step_ms, rate, hist=None, live=None):
    return {"batch_size": 16, "speculative": "DFlashDraftModel", "pinned_width": pinned,
            "step_ms": step_ms, "decode_tok_per_s": rate, "expected_decode_tok_per_s": rate,
            "width_histogram": hist, "cost_ms_by_width": live, "mean_verify_width": 1.1,
            "simulated_accept_profile": "p"}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(tmp_path, capsys, live_w1):
    ar = _write(tmp_path / "ar.jsonl", [{"batch_size": 16, "decode_tok_per_s": 3400.0}])
    spec = _write(tmp_path / "spec.jsonl", [
        {"batch_size": 16, "decode_tok_per_s": 3400.0},           # AR logged first: skipped
        _row(1, 4.75, 3360.0), _row(2, 8.5, 2740.0),
        _row(None, 4.0, 3300.0, hist=[900, 20, 0], live=[live_w1, 8.4, 9.6])])
    assert table.main([ar, spec]) == 0
    return capsys.readouterr().out


def test_comparable_row_is_scored_against_the_best_pinned_width(tmp_path, capsys):
    out = _run(tmp_path, capsys, live_w1=4.80)
    assert "('p', 'DFlashDraftModel')" in out
    line = next(x for x in out.splitlines() if x.startswith("16 |"))
    assert "3360 (w1)" in line and "| 0.982 |" in line and "| 0.971 |" in line
    assert "not comparable" not in out


def test_a_row_whose_steps_drifted_is_flagged(tmp_path, capsys):
    out = _run(tmp_path, capsys, live_w1=3.30)
    assert "not comparable: the adaptive row's width-1 steps took 3.3 ms, -31%" in out


def test_an_ar_row_of_other_text_is_flagged(tmp_path, capsys):
    """Speculative rows under simulated text against an AR row that decoded the model's own
    argmax: x AR is flagged; with --simulate-text on both it is not."""
    spec = _write(tmp_path / "spec.jsonl", [
        {**_row(1, 4.75, 3360.0), "simulated_text": True},
        {**_row(None, 4.7, 3380.0, hist=[900, 0, 0], live=[4.7, 8.4, 9.6]), "simulated_text": True}])
    own = _write(tmp_path / "own.jsonl", [{"batch_size": 16, "decode_tok_per_s": 3400.0}])
    assert table.main([own, spec]) == 0
    assert "x AR not comparable: the AR row committed the model's own text" in capsys.readouterr().out
    same = _write(tmp_path / "same.jsonl", [{"batch_size": 16, "decode_tok_per_s": 3400.0,
                                             "simulated_text": True}])
    assert table.main([same, spec]) == 0
    assert "not comparable" not in capsys.readouterr().out


def test_drift_compares_full_batch_device_times(tmp_path, capsys):
    """A pinned row whose wall-clock step (22.5 ms, its batch's tail included) is below its own
    live entry (24.8 ms) is compared by that entry: an adaptive row at 24.7 ms is comparable."""
    ar = _write(tmp_path / "ar.jsonl", [{"batch_size": 16, "decode_tok_per_s": 3400.0}])
    spec = _write(tmp_path / "spec.jsonl", [
        _row(1, 22.47, 9777.0, live=[24.77, 8.4, 9.6]),
        _row(None, 21.1, 9865.0, hist=[900, 20, 0], live=[24.72, 8.4, 9.6])])
    assert table.main([ar, spec]) == 0
    assert "not comparable" not in capsys.readouterr().out
