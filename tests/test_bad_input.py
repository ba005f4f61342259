"""Bad input gets a clear error naming the thing and what was expected; the CLI prints one line."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec import Engine
from blockspec.checkpoint import CheckpointError
from blockspec.models.nemotron_h_config import ConfigError
from blockspec.sampling import SamplingParamsError
from tests.ckpt_edit import edited_copy
from tests.hf_oracle import make_checkpoint


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


def test_sharded_checkpoint_and_dtypes(folder, tmp_path):
    tensors = load_file(str(folder / "model.safetensors"))
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text((folder / "config.json").read_text())
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / fname))
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
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
