"""Reading and writing plain safetensors checkpoints (single file or sharded with an index).

Kept separate from the engine's loader: quantize/dequantize need whole-folder tensor dicts,
not a model, and must not depend on model code.
"""
from __future__ import annotations

import json
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def safetensors_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The weight files of a folder, in index order if it is sharded."""
    model_dir = pathlib.Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [model_dir / name for name in dict.fromkeys(weight_map.values())]
    single = model_dir / SINGLE_NAME
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return found


def read_config(model_dir: pathlib.Path) -> dict:
    path = pathlib.Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def tensor_names(model_dir: pathlib.Path) -> list[str]:
    names: list[str] = []
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def load_tensors(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder (CPU), names as stored."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in out:
                    raise ValueError(f"tensor {name} appears in more than one shard")
                out[name] = f.get_tensor(name)
    return out


def save_tensors(tensors: dict[str, torch.Tensor], path: pathlib.Path,
                 metadata: dict[str, str] | None = None) -> None:
    # safetensors refuses tensors sharing storage (e.g. one fused global scale): copy repeats.
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    save_file(out, str(path), metadata={"format": "pt", **(metadata or {})})
