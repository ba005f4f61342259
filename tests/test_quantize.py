"""``quantize_checkpoint`` against ModelOpt's exporter on the same weights."""
import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from blockspec.quant.config import load_quant_plan, strip_name_sentinel
from blockspec.quant.quantize import (dequantize_checkpoint, quantize_checkpoint,
                                      summarize_excludes)
from blockspec.quant.recipes import QuantizeError

FIX = pathlib.Path(__file__).parent / "fixtures" / "modelopt"
CASES = [("w4a16_nvfp4", "W4A16_NVFP4", None), ("nvfp4", "NVFP4", None), ("fp8", "FP8", None),
         ("mixed_lightning", "MIXED_PRECISION", "lightning")]


def _clean(obj):
    if isinstance(obj, dict):
        return {strip_name_sentinel(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return strip_name_sentinel(obj) if isinstance(obj, str) else obj


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("name, algo, recipe", CASES)
def test_quantize_reproduces_modelopt_bytes_and_json(tmp_path, name, algo, recipe):
    act_amax = json.loads((FIX / name / "modelopt_dequant.json").read_text())["act_amax"]
    report = quantize_checkpoint(FIX / "dense", tmp_path / "out", algo, recipe, act_amax=act_amax)
    assert report.notices == []
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    ref = load_file(str(FIX / name / "model.safetensors"))
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, k
        assert torch.equal(_bytes(ours[k]), _bytes(ref[k])), k
    for fname in ("hf_quant_config.json", "config.json"):
        got = json.loads((tmp_path / "out" / fname).read_text())
        want = _clean(json.loads((FIX / name / fname).read_text()))
        assert got == want, fname
    assert (tmp_path / "out" / "generation_config.json").is_file()
    # and blockspec's own loader accepts the result without any sentinel notice
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    plan = load_quant_plan(tmp_path / "out", cfg, ours.keys())
    assert plan.quant_algo == algo
    assert not any("sentinel" in n for n in plan.notices)


def test_qkv_share_one_global_scale():
    out = load_file(str(FIX / "w4a16_nvfp4" / "model.safetensors"))
    p = "backbone.layers.1.mixer."
    scales = [out[p + x + ".weight_scale_2"].item() for x in ("q_proj", "k_proj", "v_proj")]
    assert scales[0] == scales[1] == scales[2]
    dense = load_file(str(FIX / "dense" / "model.safetensors"))
    amax = max(dense[p + x + ".weight"].float().abs().max().item()
               for x in ("q_proj", "k_proj", "v_proj"))
    assert scales[0] == pytest.approx(amax / 2688, rel=1e-6)


def test_without_calibration_scales_are_one_with_notice(tmp_path):
    report = quantize_checkpoint(FIX / "dense", tmp_path / "o", "MIXED_PRECISION", "lightning")
    assert report.notices and "calibration" in report.notices[0]
    ours = load_file(str(tmp_path / "o" / "model.safetensors"))
    ref = load_file(str(FIX / "mixed_lightning" / "model.safetensors"))
    assert ours["backbone.layers.0.mixer.in_proj.input_scale"].item() == 1.0
    assert ours["backbone.layers.1.mixer.k_proj.k_scale"].item() == 1.0
    for k in ref:
        if not k.endswith(("input_scale", "k_scale", "v_scale")):
            assert torch.equal(_bytes(ours[k]), _bytes(ref[k])), k


def test_round_trip_close_to_dense(tmp_path):
    quantize_checkpoint(FIX / "dense", tmp_path / "q", "W4A16_NVFP4")
    deq = dequantize_checkpoint(tmp_path / "q")
    dense = load_file(str(FIX / "dense" / "model.safetensors"))
    assert set(deq) == set(dense)
    w = dense["backbone.layers.3.mixer.experts.1.up_proj.weight"].float()
    err = (deq["backbone.layers.3.mixer.experts.1.up_proj.weight"] - w).norm() / w.norm()
    assert 0 < err < 0.15


def test_summarize_excludes_matches_modelopt_wildcards():
    # The conservative fixture: Mamba and attention layers 0-2 left in bf16.
    want = _clean(json.loads((FIX / "nvfp4_conservative" / "hf_quant_config.json")
                             .read_text()))["quantization"]["exclude_modules"]
    m = "model.layers."
    unq = ["lm_head", "model.embeddings"] + [
        f"{m}{i}.mixer.{x}" for i, xs in ((0, ("in_proj", "conv1d", "out_proj")),
                                          (1, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                          (2, ("in_proj", "conv1d", "out_proj"))) for x in xs
    ] + [f"{m}3.mixer.gate"]
    q = [f"{m}3.mixer.experts", f"{m}3.mixer.shared_experts.up_proj",
         f"{m}3.mixer.shared_experts.down_proj", f"{m}4.mixer.up_proj", f"{m}4.mixer.down_proj"]
    got = [n.replace("model.", "backbone.", 1) for n in summarize_excludes(unq, q)]
    assert got == want


@pytest.mark.parametrize("algo, recipe, match", [
    ("INT4_AWQ", None, "supported: W4A16_NVFP4, NVFP4, FP8, MIXED_PRECISION"),
    ("MIXED_PRECISION", None, "needs a --recipe"),
    ("W4A16_NVFP4", "lightning", "MIXED_PRECISION"),
    ("MIXED_PRECISION", "turbo", "unknown --recipe"),
])
def test_bad_arguments(tmp_path, algo, recipe, match):
    with pytest.raises(QuantizeError, match=match):
        quantize_checkpoint(FIX / "dense", tmp_path / "x", algo, recipe)


def test_refuses_already_quantized_input(tmp_path):
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_checkpoint(FIX / "w4a16_nvfp4", tmp_path / "x", "W4A16_NVFP4")


def test_cli_quantize_writes_a_checkpoint_the_engine_runs(tmp_path):
    """`blockspec quantize` end to end: the CLI writes ModelOpt's layout (weight-only W4A16 needs
    no calibration, so the bytes equal ModelOpt's) and the engine then serves it."""
    import subprocess
    import sys

    from blockspec import Engine

    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "blockspec.cli", "quantize", "--model-path",
                        str(FIX / "dense"), "--output", str(out), "--quant-algo", "W4A16_NVFP4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ours = load_file(str(out / "model.safetensors"))
    ref = load_file(str(FIX / "w4a16_nvfp4" / "model.safetensors"))
    assert all(torch.equal(_bytes(ours[k]), _bytes(ref[k])) for k in ref)
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = Engine(model_path=str(out), device="cpu").generate(input_ids=[5, 6, 7], sampling_params=sp)
    want = Engine(model_path=str(FIX / "w4a16_nvfp4"), device="cpu").generate(input_ids=[5, 6, 7], sampling_params=sp)
    assert got["output_ids"] == want["output_ids"]
    bad = subprocess.run([sys.executable, "-m", "blockspec.cli", "quantize", "--model-path",
                          str(tmp_path / "missing"), "--output", str(tmp_path / "x"), "--quant-algo", "FP8"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "error" in bad.stderr
