"""Draft ``config.json`` for a given target: DFlash or DSpark, generic or Nemotron-3.5 layout.

Generic layout: the draft borrows the target's embedding and LM head (no ``embed_tokens``);
DSpark uses DeepSpec's block (``sample_from_anchor`` true: gamma rows, all drafts).
Nemotron-3.5 layout: the draft has its own ``embed_tokens`` and no LM head,
``eagle_aux_hidden_state_layer_ids`` are the target layer ids + 1, ``sample_from_anchor`` is
false (gamma + 1 rows, the anchor row dropped) and the weights are W4A16_NVFP4 -- all five
conditions of ``is_nemotron_35_draft_config`` hold.
"""
from __future__ import annotations

from blockspec import __version__

LAYOUTS = ("generic", "nemotron35")
ALGORITHMS = ("dflash", "dspark")
SIZES = {
    "demo": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=768),
    "tiny": dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=64),
}
# Loss decay gamma per verify width, as the DFlash paper trains: 7 for block 16, 5 for 10, 4 for 8.
DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def decay_gamma(verify_width: int) -> float:
    return DECAY_GAMMA.get(verify_width, max(1.0, verify_width / 2))


def default_target_layer_ids(num_target_layers: int, k: int = 3) -> list[int]:
    """``k`` ids spread from layer 1 to the last layer (HF "output of layer j" convention);
    the last layer's output is the most predictive feature a small target has."""
    if num_target_layers < 2:
        return [0]
    k = min(k, num_target_layers - 1)
    if k == 1:
        return [num_target_layers - 1]
    step = (num_target_layers - 2) / (k - 1)
    return sorted({int(round(1 + i * step)) for i in range(k)})


def draft_config(target: dict, *, algorithm: str, layout: str, block_size: int, mask_token_id: int,
                 target_layer_ids: list[int], size: str = "demo", markov_rank: int = 64,
                 quantized: bool = False) -> dict:
    """``block_size``: DFlash block B (verify width B) or DSpark gamma (verify width gamma+1)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"--algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"--layout must be one of {LAYOUTS}, got {layout!r}")
    num_layers = len(target.get("layers_block_type") or target.get("hybrid_override_pattern"))
    if any(not 0 <= i < num_layers for i in target_layer_ids):
        raise ValueError(f"target layer ids {target_layer_ids} outside the target's "
                         f"{num_layers} layers")
    if algorithm == "dflash" and block_size < 2:
        raise ValueError(f"DFlash --block-size must be >= 2, got {block_size}")
    d: dict = {
        "architectures": ["DFlashDraftModel" if algorithm == "dflash" else "Qwen3DSparkModel"],
        "model_type": "qwen3", "hidden_size": target["hidden_size"], "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
        "vocab_size": target["vocab_size"], "max_position_embeddings":
            target.get("max_position_embeddings", 4096), "tie_word_embeddings": False,
        **SIZES[size],
        "block_size": block_size, "num_target_layers": num_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids),
                          "block_size": block_size},
        "dtype": "bfloat16",
    }
    if algorithm == "dspark":
        d.update(markov_rank=markov_rank, markov_head_type="vanilla")
        if layout == "generic":
            d["sample_from_anchor"] = True
    if layout == "nemotron35":
        d.update(has_embed_tokens=True, has_lm_head=False,
                 eagle_aux_hidden_state_layer_ids=[i + 1 for i in target_layer_ids])
        d["dflash_config"]["sample_from_anchor"] = False
    if quantized:
        if layout != "nemotron35":
            raise ValueError("--quantize W4A16_NVFP4 is the Nemotron-3.5 draft format; "
                             "pass --layout nemotron35")
        d["quantization_config"] = w4a16_quantization_config()
    return d


def w4a16_quantization_config() -> dict:
    """ModelOpt-style ``quantization_config`` of a W4A16_NVFP4 draft (weights only, group 16);
    the Markov W1 table is the one 2-D tensor left dense."""
    return {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16,
            "kv_cache_quant_algo": None,
            "producer": {"name": "blockspec train-draft", "version": __version__},
            "config_groups": {"group_0": {
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                "targets": ["Linear"]}},
            "ignore": ["markov_head.markov_w1"]}
