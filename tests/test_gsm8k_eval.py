"""``blockspec eval gsm8k``: answer extraction as the GSM8K scripts do it, acceptance
statistics, the plot, and the CLI's JSON line on a tiny trained family."""
from __future__ import annotations

import json

import pytest

from blockspec.cli import main as cli
from blockspec.eval.answers import extract_answer, gold_answer, same_number
from blockspec.eval.gsm8k import GSM8KResult, acceptance_stats, plot_acceptance
from tests.demo_fixtures import tiny_family


@pytest.mark.parametrize("text,want", [
    ("She has 48+24 = <<48+24=72>>72 clips.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("so the total is $18.", "18"),
    ("#### $5\nthen 99", "5"),                 # strict match wins over the last number
    ("It dropped to -7 degrees", "-7"),
    ("The answer is 3.50", "3.50"),
    ("no number here", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_gold_and_comparison():
    assert gold_answer("Step <<2*3=6>>6\n#### 6") == "6"
    assert same_number("72", "72.0") and not same_number("72", "27")
    assert not same_number(None, "1")


def test_acceptance_stats():
    # 10 verifies: 4 accepted 0 drafts, 3 accepted 1, 3 accepted 3 (verify width 4)
    verify, mean, per_pos = acceptance_stats([4, 3, 0, 3])
    assert verify == 10
    assert mean == pytest.approx((4 * 1 + 3 * 2 + 3 * 4) / 10)
    assert per_pos == pytest.approx([0.6, 0.3, 0.3])
    assert acceptance_stats([]) == (0, 0.0, [])


def test_plot_writes_png(tmp_path):
    res = GSM8KResult(num_questions=2, correct=1, accuracy=0.5, completion_tokens=10, wall_s=1.0,
                      output_throughput=10.0, verify_ct=10, accept_length=2.2,
                      accept_histogram=[4, 3, 0, 3], per_position_acceptance=[0.6, 0.3, 0.3],
                      speculative_algorithm="DFLASH")
    png = plot_acceptance(res, tmp_path / "a.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res.accept_histogram = []
    with pytest.raises(ValueError, match="speculative"):
        plot_acceptance(res, tmp_path / "b.png")


def test_cli_json_line(tmp_path, capsys):
    fam = tiny_family(tmp_path, ("dspark",))
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"Tom has {i} apples and buys 2 more. How many "
                                                    f"apples does he have?",
                                        "answer": f"{i}+2 = <<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}"})
                            + "\n" for i in range(3)))
    outs = tmp_path / "outs.jsonl"
    rc = cli(["eval", "gsm8k", "--model-path", str(fam["target"]), "--speculative-algorithm",
              "DSPARK", "--speculative-draft-model-path", str(fam["dspark"]), "--data", str(data),
              "--num-questions", "2", "--batch-size", "2", "--max-new-tokens", "8",
              "--device", "cpu", "--json", "--plot", str(tmp_path / "p.png"),
              "--save-outputs", str(outs)])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("accuracy", "accept_length", "verify_ct", "completion_tokens", "output_throughput",
                "per_position_acceptance", "accept_histogram"):
        assert key in last
    assert last["num_questions"] == 2 and last["verify_ct"] > 0 and last["completion_tokens"] > 0
    assert len(last["per_position_acceptance"]) == 3          # DSpark gamma 3
    assert (tmp_path / "p.png").is_file() and len(outs.read_text().splitlines()) == 2


def test_cli_rejects_missing_data(tmp_path, capsys):
    assert cli(["eval", "gsm8k", "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_defaults_to_the_demo_family_with_dflash(tmp_path, capsys):
    """``blockspec eval gsm8k`` with no model: the shipped family, DFlash on, the shipped test
    split; a few questions as a CPU smoke eval (the full eval is docs/demo.md's)."""
    from blockspec.demo_family import FAMILY_DIR

    png = tmp_path / "dflash.png"
    rc = cli(["eval", "gsm8k", "--num-questions", "4", "--batch-size", "4", "--device", "cpu",
              "--json", "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert out[0].startswith("gsm8k: 4 questions from gsm8k_demo_test.jsonl: accuracy 1.0000")
    assert (last["model_path"], last["draft_model_path"], last["speculative_algorithm"]) == (
        str(FAMILY_DIR / "target"), str(FAMILY_DIR / "dflash"), "DFLASH")
    assert last["accuracy"] == 1.0 and last["accept_length"] > 2.5
    assert len(last["accept_histogram"]) == 8 and png.read_bytes()[:4] == b"\x89PNG"
