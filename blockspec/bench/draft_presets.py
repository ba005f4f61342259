"""Random drafts for the bench: the generic 2-layer bf16 layout (``dflash``, ``dspark``) or
drafts shaped like Nemotron 3.5 Lightning's published ones (``dflash-nemotron35``,
``dspark-nemotron35``): the Nemotron-3.5 layout (own ``embed_tokens``, the target's LM head,
aux layers = target layers + 1, ``sample_from_anchor`` false), every Linear and the embedding
W4A16 NVFP4 like the published checkpoints (the Markov W1 table stays dense).

Assumed shapes (the published configs are not available here; the proportions follow the
published Nemotron 3.5 Bolt DFlash draft's config): 5 layers at the target's hidden size,
GQA 32 query / 8 KV heads of 128, MLP 2 x hidden, 5 captured target layers (fc 5H -> H),
full attention; DSpark adds a vanilla Markov head of rank 256. At Lightning's shapes (hidden
2688, vocab 131072) that is 0.743 B parameters for DFlash (0.352 B of them the own
embedding) and 0.810 B for DSpark. A target narrower than 1024 (tests) keeps the depth, the
MLP ratio and the captured layers with 4 heads / 1 KV head of 16 and Markov rank 32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.bench import presets
from blockspec.configs.draft import parse_draft_config
from blockspec.models.draft import build_draft_model
from blockspec.models.loader import prepare_quantized
from blockspec.quant.config import W4A16_NVFP4
from blockspec.train.draft_layout import default_target_layer_ids
from blockspec.train.draft_layout import draft_config as layout_config


@dataclass(frozen=True)
class DraftPreset:
    algorithm: str
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_ratio: int
    target_layers: int
    markov_rank: int | None = None


_NEMOTRON35 = {"num_layers": 5, "heads": 32, "kv_heads": 8, "head_dim": 128, "mlp_ratio": 2,
               "target_layers": 5}
DRAFT_PRESETS = {
    "dflash-nemotron35": DraftPreset("dflash", **_NEMOTRON35),
    "dspark-nemotron35": DraftPreset("dspark", markov_rank=256, **_NEMOTRON35),
}


class DraftNVFP4Plan:
    """The published drafts' format: W4A16 NVFP4 for every Linear and the embedding."""

    def format_for(self, prefix: str) -> str | None:
        return None if prefix == "markov_head.markov_w1" else W4A16_NVFP4


def algorithm_of(kind: str) -> str:
    """``dflash`` or ``dspark`` for a ``--random-draft`` value."""
    return DRAFT_PRESETS[kind].algorithm if kind in DRAFT_PRESETS else kind


def _num_layers(target_cfg: dict) -> int:
    return len(target_cfg.get("hybrid_override_pattern") or target_cfg.get("layers_block_type"))


def preset_config(kind: str, target_cfg: dict, block_size: int) -> dict:
    """The draft ``config.json`` of a published-size preset for this target."""
    p = DRAFT_PRESETS[kind]
    hidden, vocab = target_cfg["hidden_size"], target_cfg["vocab_size"]
    wide = hidden >= 1024
    n = _num_layers(target_cfg)
    cfg = layout_config(target_cfg, algorithm=p.algorithm, layout="nemotron35",
                        block_size=block_size, mask_token_id=vocab - 1,
                        target_layer_ids=default_target_layer_ids(n, p.target_layers),
                        markov_rank=(p.markov_rank if wide else 32) if p.markov_rank else 64,
                        quantized=True)
    cfg.update(num_hidden_layers=p.num_layers, num_attention_heads=p.heads if wide else 4,
               num_key_value_heads=p.kv_heads if wide else 1,
               head_dim=p.head_dim if wide else 16, intermediate_size=p.mlp_ratio * hidden)
    return cfg


def random_draft_config(kind: str, target_cfg: dict, block_size: int
                        ) -> tuple[dict, DraftNVFP4Plan | None]:
    """(draft config, quantization plan or None) of a ``--random-draft`` kind."""
    if kind in DRAFT_PRESETS:
        return preset_config(kind, target_cfg, block_size), DraftNVFP4Plan()
    return presets.draft_config(kind, target_cfg, block_size), None


def _build(kind: str, target_cfg: dict, block_size: int, device: torch.device | str,
           dtype: torch.dtype, quantized: bool = True) -> torch.nn.Module:
    raw, plan = random_draft_config(kind, target_cfg, block_size)
    cfg = parse_draft_config(raw, target_num_layers=_num_layers(target_cfg))
    with torch.device(device):
        return build_draft_model(cfg, plan if quantized else None, dtype)


def build_random_draft(kind: str, target_cfg: dict, block_size: int, device: torch.device,
                       dtype: torch.dtype) -> torch.nn.Module:
    """A random draft of ``kind`` on ``device`` (acceptance is meaningless: simulate it)."""
    model = _build(kind, target_cfg, block_size, device, dtype)
    presets.randomize_(model, seed=1)
    prepare_quantized(model)
    return model.eval()


def draft_sizes(kind: str, target_cfg: dict, block_size: int) -> dict:
    """Parameters of a random draft (logical, as in bf16; the target's LM head it borrows is
    not counted), the part outside its own ``embed_tokens``, and its weight bytes as built;
    from meta-device builds, so nothing is allocated."""
    dense = _build(kind, target_cfg, block_size, "meta", torch.bfloat16, quantized=False)
    built = _build(kind, target_cfg, block_size, "meta", torch.bfloat16)
    total = sum(p.numel() for p in dense.parameters())
    embed = sum(p.numel() for n, p in dense.named_parameters() if n.startswith("embed_tokens."))
    return {"draft_params": total, "draft_params_excl_embedding": total - embed,
            "draft_weight_bytes": sum(t.numel() * t.element_size()
                                      for t in built.state_dict().values())}
