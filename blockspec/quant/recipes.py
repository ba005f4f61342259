"""Which module gets which format when blockspec quantizes a dense Nemotron-H checkpoint.

Mirrors ModelOpt's own choices so that the output matches its exporter:

- ``W4A16_NVFP4``, ``NVFP4``, ``FP8`` (ModelOpt's ``*_CFG`` defaults): every Linear except
  ``lm_head`` (and MTP, which the HF model ModelOpt quantizes does not contain);
- ``MIXED_PRECISION`` with recipe ``lightning`` (Nemotron 3.5 Lightning layout): routed experts,
  shared experts and ``lm_head`` W4A16_NVFP4; Mamba ``in_proj``/``out_proj`` FP8; attention
  and dense MLP BF16; FP8 KV cache.

Modules are found from tensor names alone: a "module" is a prefix whose ``.weight`` is at least
2-D (ModelOpt puts quantizers on exactly those: Linear, Embedding, Conv1d, and lists MoE routers
explicitly).  Routed experts ``…experts.{e}.{proj}`` belong to one fused module ``…experts``, as
in transformers 5, which is how ModelOpt 0.47 names them in configs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from blockspec.quant.config import FP8, NVFP4, W4A16_NVFP4

ALGOS = ("W4A16_NVFP4", "NVFP4", "FP8", "MIXED_PRECISION")
RECIPES = ("lightning",)
_GLOBAL_FORMAT = {"W4A16_NVFP4": W4A16_NVFP4, "NVFP4": NVFP4, "FP8": FP8}
FORMAT_TO_ALGO = {W4A16_NVFP4: "W4A16_NVFP4", NVFP4: "NVFP4", FP8: "FP8"}

_EXPERT_RE = re.compile(r"^(?P<parent>.*\.experts)\.(?P<idx>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")
_EMBEDDING_NAMES = ("embeddings", "embed_tokens")
# named_modules order inside a Nemotron-H block (transformers' registration order).
_COMPONENT_RANK = {
    "backbone": 0, "lm_head": 1, "mtp": 2,
    "embeddings": 0, "layers": 1, "norm_f": 2,
    "in_proj": 0, "conv1d": 1, "out_proj": 2,
    "q_proj": 3, "k_proj": 4, "v_proj": 5, "o_proj": 6,
    "gate": 7, "experts": 8, "shared_experts": 9, "up_proj": 10, "down_proj": 11,
}
# Linears that read the same input; ModelOpt gives them one NVFP4 global scale on export.
_SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class QuantizeError(ValueError):
    """Bad arguments or an input checkpoint blockspec cannot quantize."""


def module_sort_key(name: str) -> tuple:
    """Order of ``named_modules`` in the HF model, from a checkpoint-space module name."""
    key = []
    for comp in name.split("."):
        if comp.isdigit():
            key.append((1, int(comp), ""))
        else:
            key.append((0, _COMPONENT_RANK.get(comp, 50), comp))
    return tuple(key)


@dataclass
class ModuleInventory:
    """Modules of a dense checkpoint as ModelOpt would see them."""

    linears: list[str] = field(default_factory=list)       # 2-D weights that are Linears
    others: list[str] = field(default_factory=list)        # embeddings, conv1d, routers
    expert_groups: dict[str, list[str]] = field(default_factory=dict)  # parent -> members
    attention: list[str] = field(default_factory=list)     # parents of q/k/v projections

    def group_of(self, linear: str) -> str:
        m = _EXPERT_RE.match(linear)
        return m.group("parent") if m else linear


def inventory(tensors: dict[str, torch.Tensor]) -> ModuleInventory:
    inv = ModuleInventory()
    prefixes = sorted({n[: -len(".weight")] for n, t in tensors.items()
                       if n.endswith(".weight") and t.dim() >= 2}, key=module_sort_key)
    expert_parents = {m.group("parent") for p in prefixes if (m := _EXPERT_RE.match(p))}
    for p in prefixes:
        w = tensors[p + ".weight"]
        last = p.rsplit(".", 1)[-1]
        parent = p.rsplit(".", 1)[0] if "." in p else ""
        is_router = last in ("gate", "router") and (parent + ".experts") in expert_parents
        if w.dim() != 2 or last in _EMBEDDING_NAMES or is_router:
            inv.others.append(p)
            continue
        inv.linears.append(p)
        m = _EXPERT_RE.match(p)
        if m:
            inv.expert_groups.setdefault(m.group("parent"), []).append(p)
        if last == "q_proj" and all(f"{parent}.{x}.weight" in tensors
                                    for x in ("k_proj", "v_proj")):
            inv.attention.append(parent)
    return inv


@dataclass
class Selection:
    """Format per Linear plus whether the KV cache is declared FP8."""

    formats: dict[str, str]
    kv_cache_fp8: bool


def lightning_format(prefix: str) -> str | None:
    """Nemotron 3.5 Lightning's format for one Linear: routed and shared experts and lm_head
    W4A16_NVFP4, Mamba in/out projections FP8, everything else (attention, dense MLP) bf16."""
    if ".mixer.experts." in prefix or ".mixer.shared_experts." in prefix or prefix == "lm_head":
        return W4A16_NVFP4
    if prefix.endswith(".mixer.in_proj") or prefix.endswith(".mixer.out_proj"):
        return FP8
    return None


def select_formats(inv: ModuleInventory, quant_algo: str, recipe: str | None) -> Selection:
    algo = quant_algo.upper()
    if algo not in ALGOS:
        raise QuantizeError(f"unsupported --quant-algo {quant_algo!r}; supported: "
                            + ", ".join(ALGOS))
    if recipe is not None and recipe not in RECIPES:
        raise QuantizeError(f"unknown --recipe {recipe!r}; known: " + ", ".join(RECIPES))
    if recipe == "lightning":
        if algo != "MIXED_PRECISION":
            raise QuantizeError("--recipe lightning is a MIXED_PRECISION layout; pass "
                                "--quant-algo MIXED_PRECISION")
        formats = {p: fmt for p in inv.linears
                   if not p.startswith("mtp.") and (fmt := lightning_format(p)) is not None}
        return Selection(formats, kv_cache_fp8=bool(inv.attention))
    if algo == "MIXED_PRECISION":
        raise QuantizeError("--quant-algo MIXED_PRECISION needs a --recipe; known: "
                            + ", ".join(RECIPES))
    fmt = _GLOBAL_FORMAT[algo]
    formats = {p: fmt for p in inv.linears if p != "lm_head" and not p.startswith("mtp.")}
    return Selection(formats, kv_cache_fp8=False)


def shared_input_groups(formats: dict[str, str]) -> list[list[str]]:
    """Sibling Linears reading one input, all NVFP4-family (they share weight_scale_2)."""
    groups = []
    for p, fmt in formats.items():
        if fmt == FP8 or "." not in p:
            continue
        parent, last = p.rsplit(".", 1)
        for names in _SHARED_INPUT_GROUPS:
            if last != names[0]:
                continue
            members = [f"{parent}.{n}" for n in names if f"{parent}.{n}" in formats]
            if len(members) > 1 and all(formats[m] == fmt for m in members):
                groups.append(members)
    return groups
