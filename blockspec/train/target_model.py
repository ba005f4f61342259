"""Training the target with blockspec's own Nemotron-H modules.

Why not transformers' ``NemotronHForCausalLM``: without the mamba-ssm kernels its pure-torch
Mamba-2 path (transformers 5.17, the GPU machine's version) materialises [b, c, l, l, h, n]
broadcasts per chunk, which is slow and memory-hungry for training, and its numerics would be a
second implementation next to the one that serves.  Here the training forward runs blockspec's
own mixers (the chunked SSD scan from a zero state, the relu² MLP, the routed MoE) with a plain
causal SDPA for attention (no paged pool), so the weights trained are exactly the weights
served.  Parameter names are checkpoint names; ``save_target`` writes a transformers-layout
folder (tests load it with transformers and compare logits).

MoE routing is kept balanced without an auxiliary loss: after each step the
``e_score_correction_bias`` of every router moves towards under-used experts
(``RouterBalancer``), the selection-only bias Nemotron-H's router already has.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.checkpoint import save_tensors
from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.layers.attention import Attention
from blockspec.layers.mamba2 import Mamba2Mixer
from blockspec.layers.moe import TopkRouter
from blockspec.models.nemotron_h import NemotronHForCausalLM

PATTERN_TO_TYPE = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# transformers' current spelling of the four layer kinds (config.json ``layers_block_type``)
HF_LAYER_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def hf_config(pattern: str, vocab_size: int, **sizes) -> dict:
    """A Nemotron-H ``config.json`` in transformers' spelling (blockspec reads it too)."""
    bad = sorted(set(pattern) - set(PATTERN_TO_TYPE))
    if bad:
        raise ValueError(f"pattern {pattern!r} has unknown layer kinds {bad}; use M, *, - or E")
    cfg = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "layers_block_type": [HF_LAYER_TYPE[c] for c in pattern], "vocab_size": vocab_size,
        "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 768, "mlp_hidden_act": "relu2", "mlp_bias": False,
        "mamba_num_heads": 16, "mamba_head_dim": 32, "ssm_state_size": 32, "n_groups": 2,
        "conv_kernel": 4, "chunk_size": 128, "expand": 2, "use_conv_bias": True, "use_bias": False,
        "mamba_hidden_act": "silu", "time_step_min": 0.001, "time_step_max": 0.1,
        "time_step_floor": 1e-4, "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
        "moe_shared_expert_intermediate_size": 512, "n_shared_experts": 1,
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "attention_bias": False,
        "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "residual_in_fp32": False, "rescale_prenorm_residual": True, "initializer_range": 0.02,
        "dtype": "bfloat16", "use_cache": True,
    }
    unknown = sorted(set(sizes) - set(cfg))
    if unknown:
        raise ValueError(f"unknown target config field(s): {', '.join(unknown)}")
    cfg.update(sizes)
    cfg["expand"] = cfg["mamba_num_heads"] * cfg["mamba_head_dim"] // cfg["hidden_size"] or 1
    return cfg


def build_target(cfg_dict: dict, device: torch.device, seed: int) -> NemotronHForCausalLM:
    """A freshly initialised, trainable fp32 target (every parameter requires grad)."""
    cfg = NemotronHConfig.from_dict(cfg_dict)
    with torch.device(device):
        model = NemotronHForCausalLM(cfg, dtype=torch.float32)
    init_weights(model, cfg, seed)
    model.requires_grad_(True)
    return model


@torch.no_grad()
def init_weights(model: NemotronHForCausalLM, cfg: NemotronHConfig, seed: int) -> None:
    """Nemotron-H style init: N(0, 0.02) projections with residual-branch outputs scaled by
    1/sqrt(2 * layers), Mamba A in [1, 16], D = 1, dt_bias = softplus⁻¹ of a log-uniform dt."""
    g = torch.Generator().manual_seed(seed)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.num_layers)

    def normal(t: torch.Tensor, s: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * s)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            p.zero_()
        elif "norm" in name:
            p.fill_(1.0)
        elif leaf == "A_log":
            p.copy_(torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g)))
        elif leaf == "D":
            p.fill_(1.0)
        elif leaf == "dt_bias":
            lo, hi = math.log(cfg.raw.get("time_step_min", 1e-3)), math.log(cfg.raw.get("time_step_max", 0.1))
            dt = torch.exp(torch.empty(p.shape).uniform_(lo, hi, generator=g))
            dt = dt.clamp(min=cfg.raw.get("time_step_floor", 1e-4))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif "conv1d" in name:
            bound = 1.0 / math.sqrt(cfg.conv_kernel)
            p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
        elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            normal(p, out_std)
        else:
            normal(p, std)
    for m in model.modules():
        if isinstance(m, TopkRouter):
            m.e_score_correction_bias.zero_()


def _attention(mixer: Attention, x: torch.Tensor) -> torch.Tensor:
    """Causal GQA over the batch itself (no KV pool): x [B, T, H]."""
    b, t, _ = x.shape
    q = mixer.q_proj(x).view(b, t, mixer.num_heads, mixer.head_dim).transpose(1, 2)
    k = mixer.k_proj(x).view(b, t, mixer.num_kv_heads, mixer.head_dim).transpose(1, 2)
    v = mixer.v_proj(x).view(b, t, mixer.num_kv_heads, mixer.head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=mixer.scale,
                                       enable_gqa=mixer.num_heads != mixer.num_kv_heads)
    return mixer.o_proj(o.transpose(1, 2).reshape(b, t, -1))


def _mamba(mixer: Mamba2Mixer, x: torch.Tensor) -> torch.Tensor:
    """The serving prefill scan from a zero state: x [B, T, H]."""
    b = x.shape[0]
    conv0 = x.new_zeros(b, mixer.conv_dim, mixer.K - 1)
    ssm0 = torch.zeros(b, mixer.H, mixer.P, mixer.N, device=x.device, dtype=torch.float32)
    y, _, _ = mixer.extend(x, conv0, ssm0)
    return y


def forward_hidden(model: NemotronHForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states [B, T, H] of right-padded ``ids [B, T]`` (differentiable)."""
    h = model.backbone.embeddings(ids)
    for block in model.backbone.layers:
        x = block.norm(h)
        if block.kind == "mamba":
            out = _mamba(block.mixer, x)
        elif block.kind == "attention":
            out = _attention(block.mixer, x)
        else:
            out = block.mixer(x.reshape(-1, x.shape[-1])).view_as(x)
        h = h + out
    return model.backbone.norm_f(h)


class RouterBalancer:
    """Aux-loss-free MoE balancing: counts the experts each router picks during a step and
    then nudges ``e_score_correction_bias`` by ``rate * sign(mean_load - load)``."""

    def __init__(self, model: nn.Module, rate: float = 1e-3) -> None:
        self.rate = rate
        self.counts: dict[TopkRouter, torch.Tensor] = {}
        self._hooks = [m.register_forward_hook(self._hook) for m in model.modules()
                       if isinstance(m, TopkRouter)]

    def _hook(self, router: TopkRouter, _inp, out) -> None:
        ids = out[0].detach().reshape(-1)
        n = router.e_score_correction_bias.numel()
        c = torch.bincount(ids, minlength=n).float()
        self.counts[router] = self.counts.get(router, 0) + c

    @torch.no_grad()
    def step(self) -> None:
        for router, c in self.counts.items():
            router.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
        self.counts.clear()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def save_target(model: NemotronHForCausalLM, cfg_dict: dict, folder: Path,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json + model.safetensors (``dtype``) + generation_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in model.state_dict().items():
        keep_fp32 = k.endswith(("A_log", ".D", "dt_bias", "e_score_correction_bias"))
        state[k] = v.detach().to("cpu", torch.float32 if keep_fp32 else dtype).contiguous()
    save_tensors(state, folder / "model.safetensors")
    cfg = dict(cfg_dict, dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype])
    (folder / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
           "pad_token_id": cfg["pad_token_id"], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    return folder
