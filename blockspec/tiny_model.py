"""A tiny Nemotron-H (M*ME layout) with random weights and a byte-level tokenizer, written to a
folder on request: the model the tests build their engines on and the bench's ``tiny`` preset.
Its text is noise. The model a user gets without ``--model-path`` is the trained demo family
(``blockspec/demo_family``), which needs no writes at all."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.models.nemotron_h import NemotronHForCausalLM

SPECIALS = ["<pad>", "<s>", "</s>"]
TINY_CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "hybrid_override_pattern": "M*ME", "vocab_size": 259, "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
    "conv_kernel": 4, "chunk_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64,
    "intermediate_size": 64, "routed_scaling_factor": 2.5, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "dtype": "float32",
}


def random_state(model: NemotronHForCausalLM, seed: int) -> dict[str, torch.Tensor]:
    """Plausible random weights: unit norms, Mamba-style A/D/dt, small normal projections."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            v = torch.ones(t.shape)
        elif name.endswith("A_log"):
            v = torch.log(torch.arange(1, t.numel() + 1, dtype=torch.float32))
        elif name.endswith(".D") or name.endswith("dt_bias"):
            v = torch.ones(t.shape)
        elif name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            v = torch.zeros(t.shape)
        else:
            std = 0.5 if name.endswith("gate.weight") else 0.1
            v = torch.randn(t.shape, generator=g) * std
        out[name] = v.to(t.dtype).contiguous()
    return out


def byte_level_tokenizer_json() -> str:
    """A tokenizers-library BPE with no merges over the 256 byte symbols, plus specials."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


def write_tiny_model(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = NemotronHConfig.from_dict(TINY_CONFIG)
    state = random_state(NemotronHForCausalLM(cfg, dtype=torch.float32), seed)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant: {% endif %}"}, indent=1))
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG, indent=1))
    return folder
