"""Write a trained draft as a checkpoint that ``--speculative-draft-model-path`` loads unchanged.

Dense drafts are stored in bf16 under their module names.  ``W4A16_NVFP4`` packs every 2-D
weight (fc, attention, MLP, ``embed_tokens``, DSpark ``markov_w2``) in ModelOpt's NVFP4 layout
(``weight`` uint8 + ``weight_scale`` e4m3 + ``weight_scale_2``); norms and the Markov W1 table
stay dense.  Linears that read one input (q/k/v, gate/up) share one ``weight_scale_2``, as
ModelOpt's exporter writes them for engines that fuse those projections.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from blockspec.checkpoint import save_tensors
from blockspec.quant.nvfp4 import nvfp4_global_scale, quantize_nvfp4, tensor_amax

DENSE_2D = ("markov_head.markov_w1.weight",)
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _packable(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and "norm" not in name and name not in DENSE_2D


def _global_scales(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    scales = {n[: -len(".weight")]: nvfp4_global_scale(tensor_amax(t))
              for n, t in tensors.items() if _packable(n, t)}
    for prefix in list(scales):
        parent, _, last = prefix.rpartition(".")
        for group in SHARED_INPUT:
            if last == group[0]:
                members = [f"{parent}.{m}" for m in group if f"{parent}.{m}" in scales]
                shared = torch.stack([scales[m] for m in members]).max()
                for m in members:
                    scales[m] = shared
    return scales


def pack_w4a16(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense bf16 draft tensors -> W4A16_NVFP4 tensors (see module docstring)."""
    scales = _global_scales(tensors)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not _packable(name, t):
            out[name] = t
            continue
        prefix = name[: -len(".weight")]
        packed, scale, scale2 = quantize_nvfp4(t.to(torch.bfloat16), scales[prefix])
        out[prefix + ".weight"] = packed
        out[prefix + ".weight_scale"] = scale
        out[prefix + ".weight_scale_2"] = scale2
    return out


def save_draft(model: nn.Module, cfg: dict, folder: Path, quantize: str | None = None) -> Path:
    """config.json + model.safetensors for ``model`` (a DFlash/DSpark draft module)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
               for k, v in model.state_dict().items() if v.is_floating_point()}
    if quantize is not None:
        if quantize != "W4A16_NVFP4":
            raise ValueError(f"--quantize: only W4A16_NVFP4 drafts are supported, got {quantize!r}")
        tensors = pack_w4a16(tensors)
    save_tensors(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return folder
