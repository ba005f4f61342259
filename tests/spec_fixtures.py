"""Speculative-decoding fixtures: a low-entropy tiny target (vocab <= 32) saved by transformers,
and random DFlash / DSpark draft checkpoints written in the published tensor layout.

A shared offset along one direction is added to every target embedding row: it dominates both
the target's and the draft's residual streams just enough that random drafts agree with the
target often but not always, so every acceptance length occurs in a short run."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from blockspec.models.draft import build_draft_model
from blockspec.configs.draft import parse_draft_config
from tests.hf_oracle import build_hf, save_hf

SPEC_TARGET = dict(pattern="ME*-M*E", spelling="new", vocab_size=24)


FAVOURITE = 5   # the token the shared offset pushes both target and draft towards


def make_spec_target(root: Path, offset: float = 3.0, seed: int = 0, mix: float = 0.2,
                     pull: float = 1.0) -> tuple[object, Path]:
    model = build_hf(SPEC_TARGET, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():     # quieter mixers: the embedding steers
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(mix)
        emb = model.model.embeddings.weight
        emb[FAVOURITE, 1:] = 0.0                                # the favourite leads to itself
        emb[:, 0] += offset                                    # shared offset on channel 0
        model.model.norm_f.weight[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0                       # only the favourite reads it
        model.lm_head.weight[FAVOURITE, 0] = pull
    folder = save_hf(model, root / f"spec_target_{offset}_{mix}_{pull}_{seed}", "new")
    return model, folder


CHARS = "abcdefghijklmnopqrstuvwxyz"


def write_char_tokenizer(folder: Path, vocab: int) -> Path:
    """One character per token id (``a`` = 0, ``b`` = 1, ...), no specials: text and ids map one
    to one, so a server's text answers can be compared token for token."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS[:vocab])}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def draft_config(kind: str, *, hidden: int, vocab: int, target_layers: int, block_size: int,
                 layers: int = 2, head_type: str = "vanilla", sample_from_anchor: bool | None = None,
                 nemotron: bool = False, target_layer_ids: list[int] | None = None) -> dict:
    ids = target_layer_ids or [0, target_layers // 2, target_layers - 1]
    d = {
        "architectures": ["DFlashDraftModel" if kind == "dflash" else "Qwen3DSparkModel"],
        "model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab,
        "max_position_embeddings": 4096, "block_size": block_size, "num_target_layers": target_layers,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": ids},
    }
    if kind == "dspark":
        d.update(markov_rank=8, markov_head_type=head_type)
    if sample_from_anchor is not None:
        d["dflash_config"]["sample_from_anchor"] = sample_from_anchor
    if nemotron:
        d.update(has_embed_tokens=True, has_lm_head=False,
                 eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids],
                 quantization_config={"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4",
                                      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}, "targets": ["Linear"]}},
                                      "ignore": []})
        d["dflash_config"]["sample_from_anchor"] = False
    return d


def write_draft(folder: Path, cfg_dict: dict, seed: int = 0, std: float = 0.3,
                target_embedding: torch.Tensor | None = None) -> Path:
    """Random dense weights under the checkpoint names (a 'model.' prefix on some, as seen in
    published drafts)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = parse_draft_config(cfg_dict)
    model = build_draft_model(cfg, None, torch.float32)
    model.init_random_(std=std, generator=torch.Generator().manual_seed(seed))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if target_embedding is not None and "embed_tokens.weight" in state:
        state["embed_tokens.weight"] = target_embedding.clone()
    state = {("model." + k if k.startswith("layers.0.") else k): v for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    return folder


def low_entropy_target_and_drafts(root: Path) -> tuple[Path, dict[str, Path]]:
    """The low-entropy speculative target (vocab 24) and one DFlash and one DSpark draft of
    block 4 for it: (target folder, {"DFLASH": folder, "DSPARK": folder})."""
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    drafts = {}
    for kind in ("dflash", "dspark"):
        cfg = draft_config(kind, hidden=32, vocab=24, target_layers=7, block_size=4)
        drafts[kind.upper()] = write_draft(root / kind, cfg, std=0.05)
    return folder, drafts


def quantize_draft_w4a16(folder: Path) -> Path:
    """Rewrite a dense draft in place as a Nemotron-3.5-style W4A16_NVFP4 checkpoint: every Linear
    (fc, attention, MLP, DSpark markov_w2) and embed_tokens packed, markov_w1 and norms dense."""
    from safetensors.torch import load_file

    from blockspec.quant.nvfp4 import quantize_nvfp4

    tensors = load_file(str(folder / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        bare = name.removeprefix("model.")
        packable = (t.dim() == 2 and bare.endswith(".weight") and "norm" not in bare
                    and not bare.startswith("markov_head.markov_w1"))
        if packable:
            prefix = name[: -len(".weight")]
            packed, scale, scale2 = quantize_nvfp4(t.to(torch.bfloat16))
            out[prefix + ".weight"], out[prefix + ".weight_scale"] = packed, scale
            out[prefix + ".weight_scale_2"] = scale2
        else:
            out[name] = t
    save_file(out, str(folder / "model.safetensors"))
    return folder


def exact_two_token_joint(engine, prompt: list[int], params: dict,
                          allowed: tuple[list[int], list[int]] | None = None,
                          ) -> dict[tuple[int, int], float]:
    """p(t1, t2) of target-only sampling, from the target's own logits (no speculation);
    ``allowed`` = the tokens a grammar allows first and second (the others get -inf logits)."""
    from blockspec.sampling import SamplingParams, params_to_tensors, target_probs

    def masked(logits: torch.Tensor, k: int) -> torch.Tensor:
        if allowed is None:
            return logits
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[allowed[k]] = True
        return logits.masked_fill(~keep, float("-inf"))

    tens = params_to_tensors([SamplingParams.from_dict(params)], torch.device("cpu"))
    p1 = target_probs(masked(engine.runner.score([prompt])[0][-1:], 0), *tens)[0]
    support = p1.nonzero().flatten().tolist()
    joint = {}
    for t, logits in zip(support, engine.runner.score([prompt + [t] for t in support])):
        p2 = target_probs(masked(logits[-1:], 1), *tens)[0]
        for u in p2.nonzero().flatten().tolist():
            joint[(t, u)] = float(p1[t] * p2[u])
    return joint


def two_token_chi_square_pvalue(engine, outs: list[dict], prompt: list[int], params: dict,
                                allowed: tuple[list[int], list[int]] | None = None) -> float:
    """Chi-square p-value of the sampled (t1, t2) pairs against the exact target joint (masked
    to ``allowed`` when given); see ``pairs_chi_square_pvalue``."""
    return pairs_chi_square_pvalue(outs, exact_two_token_joint(engine, prompt, params, allowed))


def pairs_chi_square_pvalue(outs: list[dict], joint: dict[tuple[int, int], float]) -> float:
    """Chi-square p-value of the sampled (t1, t2) pairs of ``outs`` against ``joint``; cells
    expected below 5 are pooled. Fails outright on a pair the law gives probability 0, or when
    too few cells are well populated for the test to mean anything."""
    from scipy.stats import chisquare

    n = len(outs)
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        counts[tuple(o["output_ids"])] = counts.get(tuple(o["output_ids"]), 0) + 1
    assert set(counts) <= set(joint), "sampled a pair the target gives probability 0"
    keys = sorted(joint, key=lambda k: -joint[k])
    big = [k for k in keys if joint[k] * n >= 5]
    assert len(big) >= 3, "too few well-populated cells for a meaningful test"
    small = [k for k in keys if joint[k] * n < 5]
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in small)]
    exp = [joint[k] * n for k in big] + [sum(joint[k] for k in small) * n]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [x * scale for x in exp]).pvalue)
