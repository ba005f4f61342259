"""Random models for benchmarks, built directly on the device (no checkpoint is written).

Shapes follow Nemotron 3.5 Lightning 30B-A3B (hidden 2688, 128 routed experts top-6 of width
1856, one shared expert of 3712, Mamba-2 with 64 x 64 heads, state 128, 8 groups, GQA 32/2 of
head dim 128, vocab 131072; layout ``MEMEM*EMEMEM*...`` of 52 layers), in bf16 or in the
Lightning quantization (routed and shared experts and lm_head W4A16_NVFP4, Mamba in/out
projections FP8, the rest bf16). Values are random but tame (unit norms, 0.02-scale weights),
so activations stay finite; they measure speed, not text.
"""
from __future__ import annotations

import math

import torch

from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.models.loader import prepare_quantized
from blockspec.models.nemotron_h import NemotronHForCausalLM
from blockspec.quant.recipes import lightning_format
from blockspec.tiny_model import TINY_CONFIG
from blockspec.train.draft_layout import default_target_layer_ids
from blockspec.train.draft_layout import draft_config as layout_config

LIGHTNING_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
_LIGHTNING = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "vocab_size": 131072, "hidden_size": 2688, "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
    "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "intermediate_size": 1856,
    "routed_scaling_factor": 2.5, "eos_token_id": 2, "dtype": "bfloat16",
    "max_position_embeddings": 262144,
}
PRESETS: dict[str, dict | None] = {
    "nemotron-3.5-lightning": {**_LIGHTNING, "hybrid_override_pattern": LIGHTNING_PATTERN},
    # 6 of Lightning's 52 layers (M E M * E M): every layer kind at full width, built quickly
    "lightning-mini": {**_LIGHTNING, "hybrid_override_pattern": "MEM*EM"},
    "tiny": None,   # the demo model's config
}


class LightningPlan:
    """Nemotron 3.5 Lightning's per-module formats (what ``quantize --recipe lightning``
    writes), as a plan a model can be built from."""

    def format_for(self, prefix: str) -> str | None:
        return lightning_format(prefix)


def preset_config(name: str) -> dict:
    if PRESETS[name] is None:
        return dict(TINY_CONFIG)
    return dict(PRESETS[name])


def weight_bytes(cfg_dict: dict, dtype: torch.dtype, quantized: bool) -> int:
    """Bytes the model's weights take (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        m = NemotronHForCausalLM(NemotronHConfig.from_dict(cfg_dict),
                                 quant=LightningPlan() if quantized else None, dtype=dtype)
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter and buffer in place with tame random values, on its own device."""
    dev = next(module.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    tensors = dict(module.named_parameters())
    tensors.update(dict(module.named_buffers()))
    for name, t in tensors.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "inv_freq":                            # RoPE table, not a weight
            continue
        if t.dtype == torch.uint8:                        # packed NVFP4 codes
            t.random_(0, 256, generator=g)
        elif t.dtype == torch.float8_e4m3fn:
            if leaf == "weight_scale":                    # NVFP4 block scales: 1.0
                t.copy_(torch.ones(t.shape, device=dev))
            else:                                         # FP8 weights
                t.copy_(torch.randn(t.shape, device=dev, generator=g).clamp(-4, 4))
        elif leaf == "weight_scale_2":                    # codes ~ +-3 -> values ~ std
            t.fill_(std / 3)
        elif leaf == "weight_scale":                      # FP8 per-tensor scale
            t.fill_(std)
        elif leaf == "input_scale":
            t.fill_(0.05)
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight") or leaf == "D":
            t.fill_(1.0)
        elif leaf == "A_log":
            t.copy_(torch.log(torch.arange(1, t.numel() + 1, device=dev, dtype=torch.float32)))
        elif leaf == "dt_bias":
            t.fill_(math.log(math.expm1(0.05)))           # softplus -> dt = 0.05
        elif leaf in ("bias", "e_score_correction_bias", "attention_sink_bias"):
            t.zero_()
        elif t.is_floating_point():
            t.normal_(0.0, 0.5 if name.endswith("gate.weight") else std, generator=g)


def build_target(name: str, device: torch.device, dtype: torch.dtype, quantized: bool = False):
    """A random preset target on ``device``, ready for ``Engine.from_model``."""
    cfg = NemotronHConfig.from_dict(preset_config(name))
    with torch.device(device):
        model = NemotronHForCausalLM(cfg, quant=LightningPlan() if quantized else None, dtype=dtype)
    randomize_(model)
    prepare_quantized(model)
    return model.eval()


def draft_config(kind: str, target_cfg: dict, block_size: int) -> dict:
    """A 2-layer DFlash / DSpark config for a target (the trainer's generic layout), with
    attention sized to the target's width: head dim 128 from hidden 1024 up, a power-of-two
    number of heads (GQA-friendly), MLP twice the width."""
    n_layers = len(target_cfg.get("hybrid_override_pattern") or target_cfg.get("layers_block_type"))
    hidden, vocab = target_cfg["hidden_size"], target_cfg["vocab_size"]
    cfg = layout_config(target_cfg, algorithm=kind, layout="generic", block_size=block_size,
                        mask_token_id=vocab - 1, target_layer_ids=default_target_layer_ids(n_layers))
    head_dim = 128 if hidden >= 1024 else 16
    heads = max(2 ** int(math.log2(max(hidden // head_dim, 1))), 2)
    cfg.update(num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=head_dim,
               intermediate_size=2 * hidden)
    return cfg


