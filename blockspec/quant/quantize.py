"""``blockspec quantize``: dense HF Nemotron-H folder -> ModelOpt-layout quantized folder.

The output matches what ModelOpt 0.47's ``export_hf_checkpoint`` writes for the same weights:
identical packed bytes and scales for every tensor, the same ``hf_quant_config.json`` and
``config.json["quantization_config"]`` fields (clean module names, i.e. without ModelOpt
0.47's sentinel corruption).  Checked against committed ModelOpt fixtures.

Activation scales (``input_scale`` of NVFP4 W4A4 and FP8 layers, ``k_scale``/``v_scale`` of an
FP8 KV cache) come from calibration, which needs a model forward.  Pass the calibrated amax per
scale-tensor name as ``act_amax`` (ModelOpt's values reproduce its bytes); without it every
such scale is written as 1.0 and a notice says so.  blockspec itself never applies them.
"""
from __future__ import annotations

import json
import pathlib
import shutil
from dataclasses import dataclass, field
from typing import Mapping

import torch

from blockspec.checkpoint import load_tensors, read_config, save_tensors
from blockspec.quant.config import FP8, NVFP4, W4A16_NVFP4, load_quant_plan
from blockspec.quant.fp8 import dequantize_fp8, fp8_scale, quantize_fp8
from blockspec.quant.nvfp4 import (E2M1_MAX, E4M3_MAX, GROUP_SIZE, dequantize_nvfp4,
                                   nvfp4_global_scale, quantize_nvfp4, tensor_amax)
from blockspec.quant.recipes import (FORMAT_TO_ALGO, QuantizeError, inventory, module_sort_key,
                                     select_formats, shared_input_groups)
from blockspec.staged_dir import staged_dir

MODELOPT_LAYOUT_VERSION = "0.47.0"
PRODUCER = {"name": "modelopt", "version": MODELOPT_LAYOUT_VERSION}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "config.json",
                 "hf_quant_config.json")


@dataclass
class QuantizeReport:
    output: pathlib.Path
    quant_algo: str
    formats: dict[str, str]
    notices: list[str] = field(default_factory=list)


def _to_model_space(name: str) -> str:
    return "model." + name[len("backbone."):] if name.startswith("backbone.") else name


def _to_checkpoint_space(name: str) -> str:
    return "backbone." + name[len("model."):] if name.startswith("model.") else name


def summarize_excludes(unquantized: list[str], quantized: list[str]) -> list[str]:
    """ModelOpt's exclude-list summary: prefix wildcards at dot boundaries that hit no
    quantized module, else the exact name; sorted (names in the HF model's namespace)."""

    def negative(wildcard: str) -> bool:
        if wildcard.endswith("*"):
            stem = wildcard[:-1]
            return any(q.startswith(stem) for q in quantized)
        return wildcard in quantized_set

    quantized_set = set(quantized)
    summary: set[str] = set()
    for name in unquantized:
        candidates = []
        for i, ch in enumerate(name):
            if ch == ".":
                candidates.append([name[:i] + "*"])
                candidates.append([name[:i], name[:i] + ".*"])
        candidates.append([name])
        chosen: list[str] = []
        for wildcards in candidates:
            if any(negative(w) for w in wildcards):
                continue
            if all(w in summary for w in wildcards):
                chosen = []
                break
            chosen = wildcards
            break
        if len(chosen) == 2 and chosen[1] == chosen[0] + ".*":
            summary.add(chosen[1])
        else:
            summary.update(chosen)
    return sorted(summary)


def _layer_entry(fmt: str) -> dict:
    if fmt == FP8:
        return {"quant_algo": "FP8"}
    return {"quant_algo": FORMAT_TO_ALGO[fmt], "group_size": GROUP_SIZE}


def build_hf_quant_config(quant_algo: str, quantized: dict[str, str], unquantized: list[str],
                          kv_cache_fp8: bool) -> dict:
    """``hf_quant_config.json`` as ModelOpt writes it (``quantized``: module -> format)."""
    kv = "FP8" if kv_cache_fp8 else None
    if quant_algo == "MIXED_PRECISION":
        layers = {name: _layer_entry(fmt) for name, fmt in quantized.items()}
        q = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": kv,
             "quantized_layers": layers}
    else:
        q = {"quant_algo": quant_algo, "kv_cache_quant_algo": kv}
        if quant_algo in ("NVFP4", "W4A16_NVFP4"):
            q["group_size"] = GROUP_SIZE
        excl = summarize_excludes([_to_model_space(n) for n in unquantized],
                                  [_to_model_space(n) for n in quantized])
        q["exclude_modules"] = [_to_checkpoint_space(n) for n in excl]
    return {"producer": dict(PRODUCER), "quantization": q}


def _group_config(algo: str, group_size: int | None) -> dict:
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size or 16}
    if algo == "FP8":
        return {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}
    if algo == "NVFP4":
        return {"input_activations": dict(fp4), "weights": dict(fp4)}
    if algo == "W4A16_NVFP4":
        return {"weights": dict(fp4)}
    raise QuantizeError(f"no config group for {algo}")


def to_quantization_config(hf_quant: dict) -> dict:
    """``config.json["quantization_config"]`` derived from ``hf_quant_config.json``."""
    q = hf_quant["quantization"]
    algo = q["quant_algo"]
    out: dict = {}
    if algo == "MIXED_PRECISION":
        by_cfg: dict[tuple, list[str]] = {}
        for name, entry in q["quantized_layers"].items():
            by_cfg.setdefault(tuple(sorted(entry.items())), []).append(name)
        groups = {}
        for i, (key, names) in enumerate(by_cfg.items()):
            entry = dict(key)
            g = _group_config(entry["quant_algo"], entry.get("group_size"))
            g["targets"] = sorted(names)
            groups[f"group_{i}"] = g
        out["config_groups"] = groups
        out["quantized_layers"] = q["quantized_layers"]
    else:
        g = _group_config(algo, q.get("group_size"))
        g["targets"] = ["Linear"]
        out["config_groups"] = {"group_0": g}
    out["ignore"] = list(q.get("exclude_modules") or [])
    out["quant_algo"] = algo
    if q.get("kv_cache_quant_algo") == "FP8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    out["producer"] = dict(hf_quant["producer"])
    out["quant_method"] = "modelopt"
    return out


def _act_scale(name: str, fmt: str, act_amax: Mapping[str, float] | None,
               missing: list[str]) -> torch.Tensor:
    if act_amax is None or name not in act_amax:
        missing.append(name)
        return torch.tensor(1.0, dtype=torch.float32)
    amax = torch.tensor(act_amax[name], dtype=torch.float32)
    if fmt == NVFP4:
        return amax / (E2M1_MAX * E4M3_MAX)
    return fp8_scale(amax)


def quantize_tensors(tensors: dict[str, torch.Tensor], quant_algo: str,
                     recipe: str | None = None, act_amax: Mapping[str, float] | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """In-memory core of ``quantize_checkpoint``: (tensors, hf_quant_config, notices)."""
    inv = inventory(tensors)
    sel = select_formats(inv, quant_algo, recipe)
    formats = sel.formats
    algo = quant_algo.upper()
    for p in formats:
        k = tensors[p + ".weight"].shape[1]
        if formats[p] != FP8 and k % GROUP_SIZE:
            raise QuantizeError(f"{p}: in_features={k} is not a multiple of {GROUP_SIZE}; "
                                f"NVFP4 cannot hold it")

    # Global scales: shared by Linears that read the same input (max of their amax).
    global_scale: dict[str, torch.Tensor] = {}
    for p, fmt in formats.items():
        if fmt != FP8:
            global_scale[p] = nvfp4_global_scale(tensor_amax(tensors[p + ".weight"]))
    for group in shared_input_groups(formats):
        shared = torch.stack([global_scale[p] for p in group]).max()
        for p in group:
            global_scale[p] = shared

    out: dict[str, torch.Tensor] = {}
    missing_amax: list[str] = []
    for name, t in tensors.items():
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix in formats:
            continue
        out[name] = t
    for p, fmt in formats.items():
        w = tensors[p + ".weight"]
        if fmt == FP8:
            q, scale = quantize_fp8(w)
            out[p + ".weight"] = q
            out[p + ".weight_scale"] = scale
            out[p + ".input_scale"] = _act_scale(p + ".input_scale", fmt, act_amax,
                                                 missing_amax)
        else:
            packed, scale, scale2 = quantize_nvfp4(w, global_scale[p])
            out[p + ".weight"] = packed
            out[p + ".weight_scale"] = scale
            out[p + ".weight_scale_2"] = scale2
            if fmt == NVFP4:
                out[p + ".input_scale"] = _act_scale(p + ".input_scale", fmt, act_amax,
                                                     missing_amax)
    if sel.kv_cache_fp8:
        for attn in inv.attention:
            for proj, scale_name in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
                name = f"{attn}.{proj}.{scale_name}"
                out[name] = _act_scale(name, FP8, act_amax, missing_amax)

    # Config: the fused experts appear once, under their parent module.
    quantized: dict[str, str] = {}
    for p in sorted(formats, key=module_sort_key):
        group = inv.group_of(p)
        quantized.setdefault(group, formats[p])
    quantized_linears = set(formats)
    unquantized = []
    for p in sorted(set(inv.linears + inv.others), key=module_sort_key):
        if p in quantized_linears or p.startswith("mtp."):
            continue
        group = inv.group_of(p)
        if group in quantized:
            continue
        if group not in unquantized:
            unquantized.append(group)
    hf_quant = build_hf_quant_config(algo, quantized, unquantized, sel.kv_cache_fp8)
    if any(n.startswith("mtp.") for n in tensors) and algo != "MIXED_PRECISION":
        hf_quant["quantization"]["exclude_modules"].append("mtp*")

    notices = []
    if missing_amax:
        notices.append(
            f"no calibration amax for {len(missing_amax)} activation scales (e.g. "
            f"{missing_amax[0]}): wrote 1.0; blockspec does not use them, W8A8/W4A4 engines do")
    return dict(sorted(out.items())), hf_quant, notices


def quantize_checkpoint(model_path: str | pathlib.Path, output: str | pathlib.Path,
                        quant_algo: str, recipe: str | None = None,
                        act_amax: Mapping[str, float] | None = None,
                        overwrite: bool = False) -> QuantizeReport:
    """Quantize a dense HF Nemotron-H folder into ModelOpt's layout at ``output``.

    ``quant_algo``: W4A16_NVFP4 | NVFP4 | FP8 | MIXED_PRECISION (needs ``recipe="lightning"``).
    Weights are quantized in their stored dtype (bf16 for HF exports), as ModelOpt does.
    Other files of the folder (tokenizer, generation config, …) are copied. A non-empty
    ``output`` is refused unless ``overwrite``, which replaces it; the folder is written whole
    or not at all (see ``staged_dir``).
    """
    src = pathlib.Path(model_path)
    dst = pathlib.Path(output)
    _check_output(src, dst, overwrite)
    config = read_config(src)
    if "quantization_config" in config:
        raise QuantizeError(f"{src} is already quantized "
                            f"({config['quantization_config'].get('quant_algo')})")
    tensors = load_tensors(src)
    qtensors, hf_quant, notices = quantize_tensors(tensors, quant_algo, recipe, act_amax)
    with staged_dir(dst) as tmp:
        for item in src.iterdir():
            if item.is_file() and item.name not in _WEIGHT_FILES and item.suffix != ".safetensors":
                shutil.copy2(item, tmp / item.name)
        save_tensors(qtensors, tmp / "model.safetensors")
        config = dict(config)
        config["quantization_config"] = to_quantization_config(hf_quant)
        with open(tmp / "config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=4)
            f.write("\n")
        with open(tmp / "hf_quant_config.json", "w", encoding="utf-8") as f:
            json.dump(hf_quant, f, indent=4)
            f.write("\n")
    formats = {p: f for p, f in sorted(_formats_of(qtensors).items())}
    return QuantizeReport(dst, quant_algo.upper(), formats, notices)


def _check_output(src: pathlib.Path, dst: pathlib.Path, overwrite: bool) -> None:
    """Refuse outputs that would destroy something: the input itself, a folder holding the
    input, a file, or (without ``overwrite``) a folder with anything in it."""
    s, d = src.resolve(), dst.resolve()
    if d == s or d in s.parents:
        raise QuantizeError(f"--output {dst} would overwrite --model-path {src}; choose another folder")
    if dst.exists() and not dst.is_dir():
        raise QuantizeError(f"--output {dst} is a file; expected a folder (new or empty)")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise QuantizeError(f"--output {dst} is not empty; pass --overwrite to replace its contents")


def _formats_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    out = {}
    for name in tensors:
        if name.endswith(".weight_scale_2"):
            p = name[: -len(".weight_scale_2")]
            out[p] = NVFP4 if p + ".input_scale" in tensors else W4A16_NVFP4
        elif name.endswith(".weight_scale") and name[:-len("_scale")] + "_scale_2" not in tensors:
            out[name[: -len(".weight_scale")]] = FP8
    return out


def dequantize_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 dense tensors under HF names; scale tensors dropped."""
    formats = _formats_of(tensors)
    drop = {".weight_scale", ".weight_scale_2", ".input_scale"}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((".k_scale", ".v_scale")):
            continue
        base, _, suffix = name.rpartition(".")
        if base in formats and "." + suffix in drop:
            continue
        if base in formats and suffix == "weight":
            if formats[base] == FP8:
                out[name] = dequantize_fp8(t, tensors[base + ".weight_scale"])
            else:
                out[name] = dequantize_nvfp4(t, tensors[base + ".weight_scale"],
                                             tensors[base + ".weight_scale_2"])
        else:
            out[name] = t.to(torch.float32)
    return out


def dequantize_checkpoint(model_dir: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """A ModelOpt folder as fp32 dense tensors under HF names (for transformers references).

    The folder's quant config is validated against its tensors first (same rules as loading).
    """
    model_dir = pathlib.Path(model_dir)
    tensors = load_tensors(model_dir)
    load_quant_plan(model_dir, read_config(model_dir), tensors.keys())
    return dequantize_tensors(tensors)
