"""Bad input gets a clear error naming the thing and what was expected; the CLI prints one line."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec import Engine
from blockspec.checkpoint import CheckpointError
from blockspec.configs.nemotron_h import ConfigError
from blockspec.sampling import SamplingParamsError
from tests.ckpt_edit import edited_copy
from tests.hf_oracle import make_checkpoint
from tests.spec_fixtures import draft_config, write_draft

FIXTURES = Path(__file__).parent / "fixtures" / "modelopt"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    _, f = make_checkpoint("basic", tmp_path_factory.mktemp("bad"))
    return f


def _copy(folder, dst, edit_cfg=None, edit_tensors=None):
    return edited_copy(folder, dst, edit_cfg, edit_tensors)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        Engine(model_path=str(tmp_path), device="cpu")


def test_unsupported_model_type(folder, tmp_path):
    d = _copy(folder, tmp_path / "m", edit_cfg=lambda c: c.update(model_type="llama"))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        Engine(model_path=str(d), device="cpu")


def test_missing_tensors_all_listed(folder, tmp_path):
    def drop(t):
        del t["backbone.layers.0.mixer.in_proj.weight"]
        del t["backbone.norm_f.weight"]
    d = _copy(folder, tmp_path / "m", edit_tensors=drop)
    with pytest.raises(CheckpointError) as e:
        Engine(model_path=str(d), device="cpu")
    assert "missing 2 tensor(s)" in str(e.value)
    assert "backbone.layers.0.mixer.in_proj.weight" in str(e.value) and "backbone.norm_f.weight" in str(e.value)


def test_unexpected_tensors_warned(folder, tmp_path, caplog):
    d = _copy(folder, tmp_path / "m", edit_tensors=lambda t: t.update({"extra.thing": torch.zeros(2)}))
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        Engine(model_path=str(d), device="cpu")
    assert "unexpected" in caplog.text and "extra.thing" in caplog.text


def test_mtp_weights_notice(folder, tmp_path, caplog):
    d = _copy(folder, tmp_path / "m", edit_cfg=lambda c: c.update(num_nextn_predict_layers=1),
              edit_tensors=lambda t: t.update({"mtp.layers.0.eh_proj.weight": torch.zeros(4, 4)}))
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        Engine(model_path=str(d), device="cpu")
    assert "MTP" in caplog.text and "unexpected" not in caplog.text


def test_shape_mismatch(folder, tmp_path):
    d = _copy(folder, tmp_path / "m", edit_tensors=lambda t: t.update(
        {"backbone.layers.1.mixer.q_proj.weight": torch.zeros(8, 32)}))
    with pytest.raises(CheckpointError, match=r"tensor 'backbone.layers.1.mixer.q_proj.weight': "
                                              r"expected shape \[32, 32\], found \[8, 32\]"):
        Engine(model_path=str(d), device="cpu")


def _sharded(folder: Path, dst: Path) -> Path:
    """The folder's tensors split over two shards with a model.safetensors.index.json."""
    tensors = load_file(str(folder / "model.safetensors"))
    dst.mkdir()
    (dst / "config.json").write_text((folder / "config.json").read_text())
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / fname))
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_sharded_checkpoint_and_dtypes(folder, tmp_path):
    d = _sharded(folder, tmp_path / "sharded")
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    ref = Engine(model_path=str(folder), device="cpu").generate(input_ids=[3, 4, 5], sampling_params=sp)
    got = Engine(model_path=str(d), device="cpu").generate(input_ids=[3, 4, 5], sampling_params=sp)
    assert got["output_ids"] == ref["output_ids"]
    for name, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)):
        e = Engine(model_path=str(d), device="cpu", dtype=name)
        assert e.model.backbone.embeddings.weight.dtype == want
        assert len(e.generate(input_ids=[3, 4, 5], sampling_params=sp)["output_ids"]) == 8
    with pytest.raises(ValueError, match="dtype must be auto, float32, bfloat16 or float16, got .int8."):
        Engine(model_path=str(d), device="cpu", dtype="int8")


@pytest.mark.parametrize("params, message", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top-p": 0.5}, "top-p"),
])
def test_invalid_sampling_params(folder, params, message):
    e = Engine(model_path=str(folder), device="cpu")
    with pytest.raises(SamplingParamsError, match=message):
        e.generate(input_ids=[1, 2], sampling_params=params)


def test_prompt_errors(folder):
    e = Engine(model_path=str(folder), device="cpu")
    with Engine(model_path=str(folder), device="cpu") as closed:
        pass
    with pytest.raises(ValueError, match="shut down"):
        closed.generate(input_ids=[1, 2])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        e.generate(prompt="hi")
    with pytest.raises(ValueError, match="exactly one of prompt or input_ids"):
        e.generate()
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 96\)"):
        e.generate(input_ids=[1, 500])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "blockspec.cli", *args], capture_output=True, text=True)


def test_cli_errors_are_one_line(folder, tmp_path):
    cases = [
        ("generate", "--model-path", str(tmp_path), "--input-ids", "1,2"),
        ("generate", "--model-path", str(folder), "--input-ids", "1,2", "--max-new-tokens", "-3"),
        ("generate", "--model-path", str(folder), "--input-ids", "1,2", "--top-p", "2"),
        ("generate", "--model-path", str(folder), "hello"),
        ("generate", "--model-path", str(folder), "--input-ids", "1,x"),
        ("generate", "--model-path", str(folder), "--input-ids", "1", "--attention-backend", "nope"),
    ]
    for args in cases:
        r = _cli(*args)
        assert r.returncode != 0, args
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
        assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in r.stderr, (args, r.stderr)


def test_cli_generate_json(folder):
    r = _cli("generate", "--model-path", str(folder), "--input-ids", "3,4,5", "--max-new-tokens", "5",
             "--ignore-eos", "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["output_ids"]) == 5 and out["meta_info"]["prompt_tokens"] == 3


# ---- broken files: one line naming the file (or flag) and what is wrong, exit code 2 ----------

def _cli_all(cases):
    """Run CLI invocations side by side (each is a fresh interpreter, as a user's would be)."""
    procs = [subprocess.Popen([sys.executable, "-m", "blockspec.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in cases]
    errs = [p.communicate()[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


def _one_line(rc, stderr, args):
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, (args, rc, stderr)
    assert lines[0].startswith("blockspec generate: error: "), lines
    return lines[0]


@pytest.fixture(scope="module")
def draft(folder, tmp_path_factory):
    cfg = draft_config("dflash", hidden=32, vocab=96, target_layers=4, block_size=4)
    return write_draft(tmp_path_factory.mktemp("bad_draft") / "draft", cfg)


def _copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


CUTS = {"half": (lambda n: n // 2, "cut short: its header declares"),
        "100_bytes": (lambda n: 100, "cut short: its header alone declares"),
        "empty": (lambda n: 0, "empty file (0 bytes), not a safetensors shard")}


def _spec_args(target, draft_path):
    return ("generate", "--model-path", str(target), "--input-ids", "1,2", "--device", "cpu",
            "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft_path))


def test_cli_broken_shards_and_empty_input_ids(folder, draft, tmp_path):
    cases, expect = [], []
    for cut, (size, what) in CUTS.items():
        t = _copy_folder(folder, tmp_path / f"target_{cut}")
        _truncate(t / "model.safetensors", size((t / "model.safetensors").stat().st_size))
        cases.append(("generate", "--model-path", str(t), "--input-ids", "1,2", "--device", "cpu"))
        expect.append(f"{t / 'model.safetensors'}: {what}")
        d = _copy_folder(draft, tmp_path / f"draft_{cut}")
        _truncate(d / "model.safetensors", size((d / "model.safetensors").stat().st_size))
        cases.append(_spec_args(folder, d))
        expect.append(f"{d / 'model.safetensors'}: {what}")
    for ids in ("", " , "):
        cases.append(("generate", "--model-path", str(folder), "--input-ids", ids))
        expect.append("--input-ids is empty")
    for args, want, (rc, stderr) in zip(cases, expect, _cli_all(cases)):
        assert want in _one_line(rc, stderr, args), (args, stderr)


def _main(capsys, caplog, *args):
    """The CLI in this process (a subprocess per case is slow); warnings it would print at its
    default log level count as lines too."""
    from blockspec.cli import main

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        rc = main(list(args))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
    lines += [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("blockspec generate: error: "), \
        (args, rc, lines)
    return lines[0]


def _edit_index(folder: Path, edit) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


def test_cli_index_family(folder, tmp_path, capsys, caplog):
    def run(d):
        return _main(capsys, caplog, "generate", "--model-path", str(d), "--input-ids", "1,2",
                     "--device", "cpu")

    d = _sharded(folder, tmp_path / "missing_shard")
    (d / "model-00002-of-00002.safetensors").unlink()
    line = run(d)
    assert f"{d / 'model.safetensors.index.json'} names shard files that do not exist" in line
    assert "model-00002-of-00002.safetensors" in line

    d = _sharded(folder, tmp_path / "ghost_tensor")
    _edit_index(d, lambda m: m.update({"backbone.layers.0.mixer.ghost": "model-00001-of-00002.safetensors"}))
    line = run(d)
    assert "lists tensor(s) that their shard does not hold" in line
    assert "'backbone.layers.0.mixer.ghost' -> model-00001-of-00002.safetensors" in line

    d = _sharded(folder, tmp_path / "wrong_shard")             # a real tensor, the wrong shard
    _edit_index(d, lambda m: m.update({"backbone.norm_f.weight": "model-00001-of-00002.safetensors"}))
    assert "'backbone.norm_f.weight' -> model-00001-of-00002.safetensors" in run(d)

    d = _sharded(folder, tmp_path / "bad_json")
    (d / "model.safetensors.index.json").write_text("{\"weight_map\": ")
    assert f"{d / 'model.safetensors.index.json'}: not a valid safetensors index" in run(d)

    d = _sharded(folder, tmp_path / "no_map")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    assert "no weight_map" in run(d)

    d = _sharded(folder, tmp_path / "twice")                    # no index: shards are globbed
    (d / "model.safetensors.index.json").unlink()
    first, second = d / "model-00001-of-00002.safetensors", d / "model-00002-of-00002.safetensors"
    tensors = load_file(str(second))
    tensors.update(load_file(str(first)))
    save_file(tensors, str(second))
    line = run(d)
    assert "is in both" in line and str(first) in line and str(second) in line


def test_cli_dtype_contradicting_the_config(folder, draft, tmp_path, capsys, caplog):
    def run(d):
        return _main(capsys, caplog, "generate", "--model-path", str(d), "--input-ids", "1,2",
                     "--device", "cpu")

    # an integer tensor for a float parameter
    d = _copy(folder, tmp_path / "int_norm", edit_tensors=lambda t: t.update(
        {"backbone.norm_f.weight": torch.ones(32, dtype=torch.int32)}))
    line = run(d)
    assert f"{d / 'model.safetensors'}: tensor 'backbone.norm_f.weight' has dtype torch.int32" in line
    assert "plain torch.float32 weight" in line
    # an FP8 tensor in a folder with no quantization config (its scale would be lost)
    d = _copy(folder, tmp_path / "fp8_dense", edit_tensors=lambda t: t.update(
        {"backbone.layers.1.mixer.q_proj.weight": torch.zeros(32, 32, dtype=torch.float8_e4m3fn)}))
    line = run(d)
    assert "'backbone.layers.1.mixer.q_proj.weight' has dtype torch.float8_e4m3fn" in line
    assert "plain torch.float32 weight (only a quantization config" in line
    # a float tensor where the quantization config wants a packed uint8 one
    q = _copy_folder(FIXTURES / "w4a16_nvfp4", tmp_path / "float_packed")
    for js in ("config.json", "hf_quant_config.json"):   # ModelOpt 0.47's name junk: its notice
        f = q / js                                        # is a warning line of its own
        f.write_text(f.read_text().replace(".\\u0000backbone.pt_name_sentinel", ""))
    tensors = load_file(str(q / "model.safetensors"))
    tensors["backbone.layers.1.mixer.q_proj.weight"] = torch.zeros(32, 16)
    save_file(tensors, str(q / "model.safetensors"))
    line = run(q)
    assert "'backbone.layers.1.mixer.q_proj.weight' has dtype torch.float32" in line
    assert "quantization config makes it a torch.uint8 tensor" in line
    # drafts alike
    d = _copy(draft, tmp_path / "int_draft", edit_tensors=lambda t: t.update(
        {"norm.weight": torch.ones(32, dtype=torch.int64)}))
    line = _main(capsys, caplog, *_spec_args(folder, d))
    assert f"{d / 'model.safetensors'}: tensor 'norm.weight' has dtype torch.int64" in line


def test_legitimate_dtype_casts_still_load(folder, tmp_path):
    d = _copy(folder, tmp_path / "bf16", edit_tensors=lambda t: t.update(
        {k: v.to(torch.bfloat16) for k, v in t.items()}))
    e = Engine(model_path=str(d), device="cpu", dtype="float32")
    assert e.model.backbone.norm_f.weight.dtype == torch.float32
    assert len(e.generate(input_ids=[3, 4], sampling_params={"max_new_tokens": 2})["output_ids"]) == 2


@pytest.mark.parametrize("key, nested", [("sample_from_anchor", True),
                                         ("query_zero_predicts_next", False)])
def test_cli_draft_layout_refused_at_load(folder, draft, tmp_path, capsys, caplog, key, nested):
    def edit(c):
        (c["dflash_config"] if nested else c)[key] = True
    d = _copy(draft, tmp_path / "anchor_first", edit_cfg=edit)
    line = _main(capsys, caplog, *_spec_args(folder, d))
    assert f"{'dflash_config.' if nested else ''}{key}=true" in line and "1+N query layout" in line


@pytest.mark.parametrize("content, what", [(b"[1, 2]", "expected a JSON object, got list"),
                                           (b"\xff\xfe{", "not valid JSON"),
                                           (b"", "not valid JSON")])
def test_cli_broken_config_json(folder, draft, tmp_path, capsys, caplog, content, what):
    t = _copy_folder(folder, tmp_path / "target")
    (t / "config.json").write_bytes(content)
    line = _main(capsys, caplog, "generate", "--model-path", str(t), "--input-ids", "1,2")
    assert f"{t / 'config.json'}: {what}" in line
    d = _copy_folder(draft, tmp_path / "draft")
    (d / "config.json").write_bytes(content)
    assert f"{d / 'config.json'}: {what}" in _main(capsys, caplog, *_spec_args(folder, d))
