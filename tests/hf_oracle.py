"""Tiny Nemotron-H checkpoints written by transformers' own ``save_pretrained`` (the oracle for
tensor names and numerics) plus target-only reference decoding with the transformers model."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LEGACY = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size"}
TO_PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
FROM_PATTERN = {v: k for k, v in TO_PATTERN.items()}

BASE = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
            conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
            routed_scaling_factor=2.5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# >= 5 configurations covering every layer kind, latent MoE, n_group > 1, tied/untied, both spellings.
CONFIGS = {
    "basic": dict(pattern="M*ME", spelling="new"),
    "legacy_tied": dict(pattern="MEM*E-", spelling="legacy", tie_word_embeddings=True),
    "latent_moe": dict(pattern="ME*E", spelling="new", moe_latent_size=16),
    "group_routing": dict(pattern="*MEM", spelling="legacy", n_routed_experts=8,
                          num_experts_per_tok=3, n_group=4, topk_group=2),
    "mixed_chunks": dict(pattern="-M*-EM", spelling="new", tie_word_embeddings=True, chunk_size=4,
                         n_groups=1, mamba_num_heads=2, mamba_head_dim=16),
}


def build_hf(name: str | dict, seed: int = 0):
    """A transformers NemotronHForCausalLM with peaked random weights (so greedy is stable);
    ``name`` is a key of CONFIGS or such a spec dict itself."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    spec = dict(CONFIGS[name] if isinstance(name, str) else name)
    pattern = spec.pop("pattern")
    spec.pop("spelling")
    kw = {**BASE, **spec, "layers_block_type": [FROM_PATTERN[c] for c in pattern]}
    cfg = NemotronHConfig(**kw)
    cfg.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif pname.endswith("A_log"):
                p.copy_(torch.log(torch.linspace(0.5, 4.0, p.numel())))
            elif pname.endswith(".D") or pname.endswith("dt_bias"):
                p.copy_(0.5 + 0.5 * torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 if "gate" in pname else 0.25))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
        if cfg.tie_word_embeddings:
            model.lm_head.weight.copy_(model.model.embeddings.weight if hasattr(model, "model")
                                       else model.backbone.embeddings.weight)
    return model


def save_hf(model, folder: Path, spelling: str, drop_tied_head: bool = True) -> Path:
    """save_pretrained, then rewrite config.json in the hub's legacy spelling when asked and drop
    lm_head.weight from tied checkpoints (as tied hub checkpoints do). With
    ``drop_tied_head=False`` the folder keeps the head transformers wrote: its NemotronH never
    ties, so a tied config then carries an lm_head.weight of its own."""
    model.save_pretrained(folder)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if spelling == "legacy":
        cfg["hybrid_override_pattern"] = "".join(TO_PATTERN[t] for t in cfg.pop("layers_block_type"))
        cfg["num_hidden_layers"] = len(cfg["hybrid_override_pattern"])
        for new, old in LEGACY.items():
            cfg[old] = cfg.pop(new)
        cfg["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    cfg_path.write_text(json.dumps(cfg, indent=1))
    if cfg.get("tie_word_embeddings") and drop_tied_head:
        st = folder / "model.safetensors"
        tensors = load_file(str(st))
        tensors.pop("lm_head.weight", None)
        save_file(tensors, str(st), metadata={"format": "pt"})
    return folder


def make_checkpoint(name: str, root: Path, seed: int = 0):
    model = build_hf(name, seed)
    folder = save_hf(model, root / name, CONFIGS[name]["spelling"])
    return model, folder


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding with full recomputation each step (no cache involved)."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


@torch.no_grad()
def hf_greedy_logprobs(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Target-only greedy decoding (full recomputation) with log p of each chosen token under
    the model's raw distribution (blockspec's ``output_token_logprobs``)."""
    ids, lps = list(prompt), []
    for _ in range(n):
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        ids.append(int(logp.argmax()))
        lps.append(float(logp[ids[-1]]))
    return ids[len(prompt):], lps
