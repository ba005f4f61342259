"""Quant config parsing: the committed ModelOpt fixtures and synthetic bad configs."""
import json
import pathlib

import pytest
from safetensors import safe_open

from blockspec.quant.config import (QuantConfigError, load_quant_plan, strip_name_sentinel)

FIX = pathlib.Path(__file__).parent / "fixtures" / "modelopt"
L = "backbone.layers"


def _plan(name: str):
    d = FIX / name
    config = json.loads((d / "config.json").read_text())
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    return load_quant_plan(d, config, names)


def _synthetic(tmp_path, quantization: dict, names, config: dict | None = None):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quantization}))
    return load_quant_plan(tmp_path, config or {}, names)


def _nvfp4_names(prefix, input_scale=False):
    out = [prefix + ".weight", prefix + ".weight_scale", prefix + ".weight_scale_2"]
    return out + ([prefix + ".input_scale"] if input_scale else [])


def test_dense_fixture_has_no_plan():
    assert _plan("dense") is None


def test_w4a16_fixture():
    plan = _plan("w4a16_nvfp4")
    assert plan.quant_algo == "W4A16_NVFP4" and plan.group_size == 16
    assert not plan.kv_cache_fp8
    assert len(plan.quantized_prefixes("w4a16_nvfp4")) == 20
    assert plan.format_for("lm_head") is None
    assert plan.format_for("backbone.embeddings") is None
    assert plan.format_for(f"{L}.3.mixer.gate") is None
    for p in (f"{L}.0.mixer.in_proj", f"{L}.1.mixer.q_proj", f"{L}.3.mixer.experts.3.down_proj",
              f"{L}.3.mixer.shared_experts.up_proj", f"{L}.4.mixer.up_proj"):
        assert plan.format_for(p) == "w4a16_nvfp4"
    # the exclude list came with ModelOpt 0.47's sentinel junk; it is stripped and reported
    assert "lm_head" in plan.exclude
    assert all("\x00" not in e for e in plan.exclude)
    assert any("name-sentinel" in n for n in plan.notices)


def test_nvfp4_w4a4_fixture_is_run_as_w4a16_with_notice():
    plan = _plan("nvfp4")
    assert plan.quant_algo == "NVFP4"
    assert plan.format_for(f"{L}.1.mixer.o_proj") == "nvfp4"
    assert len(plan.quantized_prefixes("nvfp4")) == 20
    assert any("W4A4" in n and "W4A16" in n for n in plan.notices)


def test_fp8_fixture():
    plan = _plan("fp8")
    assert plan.quant_algo == "FP8"
    assert plan.format_for(f"{L}.2.mixer.out_proj") == "fp8"
    assert plan.format_for("lm_head") is None


def test_wildcard_excludes_from_conservative_recipe():
    plan = _plan("nvfp4_conservative")
    assert f"{L}.0*" in plan.exclude
    for p in (f"{L}.0.mixer.in_proj", f"{L}.1.mixer.q_proj", f"{L}.2.mixer.out_proj"):
        assert plan.format_for(p) is None
    assert plan.format_for(f"{L}.3.mixer.experts.1.up_proj") == "nvfp4"
    assert plan.format_for(f"{L}.4.mixer.down_proj") == "nvfp4"


def test_mixed_precision_lightning_fixture():
    plan = _plan("mixed_lightning")
    assert plan.quant_algo == "MIXED_PRECISION"
    assert plan.kv_cache_fp8
    assert plan.kv_scale_names == {f"{L}.1.mixer.k_proj.k_scale", f"{L}.1.mixer.v_proj.v_scale"}
    # the parent entry "...mixer.experts" covers every expert projection
    assert f"{L}.3.mixer.experts" in plan.quantized_layers
    for e in range(4):
        assert plan.format_for(f"{L}.3.mixer.experts.{e}.up_proj") == "w4a16_nvfp4"
    assert plan.format_for("lm_head") == "w4a16_nvfp4"
    assert plan.format_for(f"{L}.0.mixer.in_proj") == "fp8"
    assert plan.format_for(f"{L}.1.mixer.q_proj") is None      # attention stays bf16
    assert plan.format_for(f"{L}.4.mixer.up_proj") is None     # absent = unquantized
    assert any("KV cache" in n and "bf16" in n for n in plan.notices)


def test_strip_name_sentinel():
    assert strip_name_sentinel("lm_head.\x00backbone.pt_name_sentinel") == "lm_head"
    assert strip_name_sentinel("backbone.layers.0.\x00backbone.pt_name_sentinel*") == \
        "backbone.layers.0*"
    assert strip_name_sentinel("x.\x00modelopt_name_sentinel") == "x"
    assert strip_name_sentinel("backbone.layers.1.mixer.q_proj") == "backbone.layers.1.mixer.q_proj"


def test_config_json_only(tmp_path):
    qc = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4",
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                    "group_size": 16}}},
          "ignore": ["lm_head", "backbone.layers.0.*"]}
    names = _nvfp4_names(f"{L}.1.mixer.in_proj") + [f"{L}.0.mixer.in_proj.weight", "lm_head.weight"]
    plan = load_quant_plan(tmp_path, {"quantization_config": qc}, names)
    assert plan.format_for(f"{L}.1.mixer.in_proj") == "w4a16_nvfp4"
    assert plan.format_for(f"{L}.0.mixer.in_proj") is None
    assert plan.format_for("lm_head") is None
    assert plan.group_size == 16 and plan.notices == []


def test_unknown_quant_algo_lists_supported(tmp_path):
    with pytest.raises(QuantConfigError) as e:
        _synthetic(tmp_path, {"quant_algo": "INT4_AWQ", "group_size": 128}, [])
    msg = str(e.value)
    assert "INT4_AWQ" in msg
    for algo in ("FP8", "MIXED_PRECISION", "NVFP4", "W4A16_NVFP4"):
        assert algo in msg


def test_unknown_algo_inside_quantized_layers(tmp_path):
    with pytest.raises(QuantConfigError, match=r"NVFP4_AWQ.*supported: FP8, MIXED_PRECISION"):
        _synthetic(tmp_path, {"quant_algo": "MIXED_PRECISION",
                              "quantized_layers": {"lm_head": {"quant_algo": "NVFP4_AWQ"}}}, [])


def test_group_size_32_is_rejected(tmp_path):
    with pytest.raises(QuantConfigError, match="group_size 32"):
        _synthetic(tmp_path, {"quant_algo": "NVFP4", "group_size": 32, "exclude_modules": []}, [])
    with pytest.raises(QuantConfigError, match="group_size 32"):
        _synthetic(tmp_path, {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
            "lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 32}}}, [])
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4",
          "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}}
    with pytest.raises(QuantConfigError, match="group_size 32"):
        load_quant_plan(tmp_path / "none", {"quantization_config": qc}, [])


def test_missing_weight_scale_2_lists_names(tmp_path):
    p = f"{L}.0.mixer.in_proj"
    with pytest.raises(QuantConfigError) as e:
        _synthetic(tmp_path, {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []},
                   [p + ".weight", p + ".weight_scale", p + ".input_scale"])
    assert f"{p}.weight_scale_2" in str(e.value)


def test_missing_weight_scale_lists_names(tmp_path):
    p = f"{L}.0.mixer.in_proj"
    with pytest.raises(QuantConfigError) as e:
        _synthetic(tmp_path, {"quant_algo": "W4A16_NVFP4", "group_size": 16,
                              "exclude_modules": []}, [p + ".weight", p + ".weight_scale_2"])
    assert f"{p}.weight_scale" in str(e.value)


def test_weight_without_any_scale_is_reported_when_asked_for(tmp_path):
    a, b = f"{L}.0.mixer.in_proj", f"{L}.0.mixer.out_proj"
    plan = _synthetic(tmp_path, {"quant_algo": "W4A16_NVFP4", "group_size": 16,
                                 "exclude_modules": []}, _nvfp4_names(a) + [b + ".weight"])
    assert plan.format_for(a) == "w4a16_nvfp4"
    with pytest.raises(QuantConfigError) as e:
        plan.format_for(b)
    assert f"{b}.weight_scale" in str(e.value) and f"{b}.weight_scale_2" in str(e.value)


def test_dense_router_missing_from_exclude_list_loads_dense_with_notice(tmp_path):
    # ModelOpt before 0.4x did not list MoE routers (not nn.Linear) in exclude_modules.
    gate = f"{L}.3.mixer.gate"
    plan = _synthetic(tmp_path, {"quant_algo": "NVFP4", "group_size": 16,
                                 "exclude_modules": ["lm_head"]}, [gate + ".weight"])
    assert plan.format_for(gate) is None
    assert any(gate in n and "router" in n for n in plan.notices)


def test_conflict_between_config_and_tensors_names_the_module(tmp_path):
    p = f"{L}.0.mixer.in_proj"
    layers = {p: {"quant_algo": "FP8"}}
    with pytest.raises(QuantConfigError) as e:
        _synthetic(tmp_path, {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers},
                   _nvfp4_names(p))
    assert p in str(e.value) and "fp8" in str(e.value)


def test_excluded_module_with_scales_is_a_conflict(tmp_path):
    p = "lm_head"
    with pytest.raises(QuantConfigError, match="lm_head.*leaves this module unquantized"):
        _synthetic(tmp_path, {"quant_algo": "W4A16_NVFP4", "group_size": 16,
                              "exclude_modules": ["lm_head"]}, _nvfp4_names(p))


def test_sentinel_corrupted_mixed_names_resolve(tmp_path):
    junk = ".\x00backbone.pt_name_sentinel"
    p = f"{L}.5.mixer.experts"
    plan = _synthetic(tmp_path, {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        p + junk: {"quant_algo": "W4A16_NVFP4", "group_size": 16}}},
        _nvfp4_names(p + ".7.up_proj"))
    assert plan.format_for(p + ".7.up_proj") == "w4a16_nvfp4"
    assert plan.format_for(p + ".100.down_proj") == "w4a16_nvfp4"
    assert any("name-sentinel" in n for n in plan.notices)


def test_scales_without_any_config(tmp_path):
    with pytest.raises(QuantConfigError, match="neither hf_quant_config.json nor"):
        load_quant_plan(tmp_path, {}, _nvfp4_names("lm_head"))


def test_sources_disagreeing_on_algo(tmp_path):
    qc = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    with pytest.raises(QuantConfigError, match="disagree on quant_algo"):
        load_quant_plan(tmp_path, {"quantization_config": qc}, [])


def test_non_modelopt_quant_method(tmp_path):
    with pytest.raises(QuantConfigError, match="compressed-tensors"):
        load_quant_plan(tmp_path, {"quantization_config": {"quant_method": "compressed-tensors"}},
                        [])
