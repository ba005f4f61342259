"""How an Engine without a model path picks the shipped demo family; the family's size, its
package data, and a CPU smoke eval of every member (lossless against the target)."""
from __future__ import annotations

from pathlib import Path

import pytest

from blockspec.demo_family import (FAMILY_DIR, MEMBERS, SIZE_LIMIT_BYTES, demo_engine_kwargs,
                                   family_bytes, is_shipped, member_path)


def _fake_family(root):
    for m in MEMBERS:
        (root / m).mkdir(parents=True)
        (root / m / "config.json").write_text("{}")
        (root / m / "model.safetensors").write_bytes(b"")
    return root


def test_a_missing_family_is_an_error_not_a_stand_in(tmp_path):
    assert not is_shipped(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"demo family at .* is incomplete \(missing "
                                                r"target/config.json, .*--model-path"):
        demo_engine_kwargs(None, {"device": "cpu"}, tmp_path)
    assert demo_engine_kwargs("/m", {"device": "cpu"}, tmp_path) == ("/m", {"device": "cpu"})


def test_shipped_family_defaults_to_dflash(tmp_path):
    root = _fake_family(tmp_path)
    path, kw = demo_engine_kwargs(None, {"device": "cpu"}, root)
    assert path == str(root / "target")
    assert kw == {"device": "cpu", "speculative_algorithm": "DFLASH",
                  "speculative_draft_model_path": str(root / "dflash")}
    _, kw = demo_engine_kwargs(None, {"speculative_algorithm": "dspark"}, root)
    assert kw["speculative_draft_model_path"] == str(root / "dspark")
    _, kw = demo_engine_kwargs(None, {"speculative_algorithm": "none"}, root)
    assert kw["speculative_algorithm"] is None and "speculative_draft_model_path" not in kw
    # an explicit model path or draft is never overridden
    assert demo_engine_kwargs("/m", {}, root) == ("/m", {})
    _, kw = demo_engine_kwargs(None, {"speculative_draft_model_path": "/d"}, root)
    assert kw["speculative_draft_model_path"] == "/d"
    with pytest.raises(ValueError, match="member"):
        member_path("nope", root)


def test_shipped_family_fits_the_size_budget():
    assert is_shipped(), "blockspec/demo_family is incomplete"
    assert family_bytes() <= SIZE_LIMIT_BYTES


def test_package_data_ships_every_family_file():
    """A non-editable install carries the family: pyproject's package-data globs match every
    file of every member (weights, configs, tokenizer) and the shipped test split."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["blockspec"]
    pkg = root / "blockspec"
    files = [f for m in MEMBERS for f in (pkg / "demo_family" / m).iterdir() if f.is_file()]
    files.append(pkg / "gsm8k_data" / "gsm8k_demo_test.jsonl")
    assert {f.name for f in files} >= {"model.safetensors", "config.json", "tokenizer.json",
                                       "tokenizer_config.json", "hf_quant_config.json"}
    for f in files:
        rel = f.relative_to(pkg).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not in package-data"


@pytest.fixture(scope="module")
def questions():
    from blockspec.gsm8k_data.generator import read_jsonl
    from blockspec.eval.gsm8k import DEFAULT_DATA

    return read_jsonl(DEFAULT_DATA)[:6]


def _answers(engine, rows):
    from blockspec.eval.gsm8k import run_gsm8k

    return run_gsm8k(engine, rows, batch_size=len(rows), progress=False)


def test_engine_without_model_path_is_the_family_with_dflash_and_lossless(questions):
    """A CPU smoke eval of the shipped family: Engine() is the family target with the DFlash
    draft; DFlash, DSpark and no speculation agree answer for answer and are right; the drafts
    are accepted well beyond chance."""
    from blockspec.engine import Engine

    results = {}
    for algo in (None, "DSPARK", "NONE"):
        engine = Engine(device="cpu", dtype="float32",
                        **({"speculative_algorithm": algo} if algo else {}))
        try:
            want_algo = {None: "DFLASH", "DSPARK": "DSPARK", "NONE": None}[algo]
            assert engine.args.model_path == str(FAMILY_DIR / "target")
            assert engine.args.speculative_algorithm == want_algo
            assert engine.args.speculative_draft_model_path == (
                str(FAMILY_DIR / want_algo.lower()) if want_algo else None)
            assert engine.verify_width == (8 if want_algo else 0)
            results[algo] = _answers(engine, questions)
        finally:
            engine.shutdown()
    dflash, dspark, off = results[None], results["DSPARK"], results["NONE"]
    assert off.correct == len(questions), off.predictions
    assert dflash.predictions == dspark.predictions == off.predictions
    assert dflash.completion_tokens == dspark.completion_tokens == off.completion_tokens
    assert off.verify_ct == 0
    assert dflash.accept_length > 2.5 and dspark.accept_length > 2.5, (dflash, dspark)


def test_nemotron35_nvfp4_drafts_and_mixed_target_run_losslessly(questions):
    """The W4A16 Nemotron-3.5-layout drafts behind the bf16 target, and the MIXED_PRECISION
    target, on a few shipped questions: the same answers as the target alone."""
    from blockspec.engine import Engine

    rows = questions[:3]

    def run(member, draft=None, algo=None):
        engine = Engine(str(FAMILY_DIR / member), device="cpu", dtype="float32",
                        speculative_algorithm=algo,
                        speculative_draft_model_path=str(FAMILY_DIR / draft) if draft else None)
        try:
            return _answers(engine, rows)
        finally:
            engine.shutdown()

    base = run("target")
    assert base.correct == len(rows)
    for draft, algo in (("dflash_nvfp4", "DFLASH"), ("dspark_nvfp4", "DSPARK")):
        res = run("target", draft, algo)
        assert res.predictions == base.predictions, draft
        assert res.accept_length > 2.0, (draft, res.accept_length)
    assert run("target_mixed").predictions == base.predictions
