"""End-to-end decode benchmark: tokens/s, per-step time and achieved weight bandwidth.

    blockspec bench [--model-path P | --random-config lightning-mini] [--speculative-algorithm
        DFLASH --speculative-draft-model-path D] --batch-size 1 --input-len 128 --output-len 128

Decode time excludes prefill (a max_new_tokens=1 run is timed separately and subtracted).
Achieved GB/s = weight bytes one step must read / step time, where the bytes are every dense
parameter plus, per MoE layer, the expected number of distinct experts a step touches under
uniform routing, D(n) = E (1 - (1 - k/E)^n) with n = batch x verify width (anchors.md §5.2).
The floor compares against the H200's 4.8 TB/s.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blockspec.bench.bench_args import add_arguments  # noqa: F401  (the CLI's flags)

H200_BW = 4.8e12

RANDOM_CONFIGS = {
    # Lightning's shapes (hidden 2688, 128 experts top-6, 64x64 Mamba heads, 32/2 GQA, vocab
    # 131072) with 6 of its 52 layers (M E M * E M), so it is written quickly anywhere.
    "lightning-mini": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hybrid_override_pattern": "MEM*EM", "vocab_size": 131072, "hidden_size": 2688,
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
        "conv_kernel": 4, "chunk_size": 128, "n_routed_experts": 128, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "intermediate_size": 1856, "routed_scaling_factor": 2.5, "eos_token_id": 2,
        "dtype": "bfloat16",
    },
    "tiny": None,   # the demo model
}


def write_random_model(name: str, root: Path) -> Path:
    from safetensors.torch import save_file

    from blockspec.demo import random_state, write_demo_model
    from blockspec.models.nemotron_h import NemotronHForCausalLM
    from blockspec.models.nemotron_h_config import NemotronHConfig

    folder = root / name
    if RANDOM_CONFIGS[name] is None:
        return write_demo_model(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = NemotronHConfig.from_dict(RANDOM_CONFIGS[name])
    with torch.device("meta"):
        shapes = NemotronHForCausalLM(cfg, dtype=torch.bfloat16)
    state = random_state(_Materialized(shapes), seed=0)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(RANDOM_CONFIGS[name]))
    return folder


def write_random_draft(kind: str, target_folder: Path, block_size: int) -> Path:
    """A random DFlash/DSpark draft for a target folder (acceptance will be near 1: this measures
    the per-step cost of drafting + verifying, not a trained draft's speed-up)."""
    from safetensors.torch import save_file

    from blockspec.models.dflash import build_draft_model
    from blockspec.models.draft_config import parse_draft_config

    t = json.loads((target_folder / "config.json").read_text())
    n_layers = len(t.get("hybrid_override_pattern") or t.get("layers_block_type"))
    hidden, vocab = t["hidden_size"], t["vocab_size"]
    head_dim = 128 if hidden >= 1024 else 16
    heads = max(2 ** int(math.log2(max(hidden // head_dim, 1))), 2)     # power of two: GQA-friendly
    cfg = {"architectures": ["DFlashDraftModel" if kind == "dflash" else "Qwen3DSparkModel"],
           "model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": 2,
           "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1),
           "head_dim": head_dim, "intermediate_size": 2 * hidden, "vocab_size": vocab,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "block_size": block_size,
           "num_target_layers": n_layers,
           "dflash_config": {"mask_token_id": vocab - 1}}
    if kind == "dspark":
        cfg.update(markov_rank=64, markov_head_type="vanilla")
    folder = target_folder.parent / f"{target_folder.name}-{kind}-b{block_size}"
    folder.mkdir(parents=True, exist_ok=True)
    model = build_draft_model(parse_draft_config(cfg), None, torch.float32)
    model.init_random_(std=0.02, generator=torch.Generator().manual_seed(1))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


class _Materialized:
    """state_dict() of a meta model as real (empty CPU) tensors, for random_state."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        # bf16 placeholders keep the random state at half the size; SSM parameters stay fp32
        fp32 = ("A_log", ".D", "dt_bias", "e_score_correction_bias")
        return {k: torch.empty(v.shape, dtype=torch.float32 if k.endswith(fp32) else torch.bfloat16)
                for k, v in self.model.state_dict().items()}


def step_weight_bytes(model: torch.nn.Module, tokens_per_step: int) -> float:
    """Bytes of weights one forward over ``tokens_per_step`` tokens must read."""
    cfg = model.cfg
    total = 0.0
    for name, t in model.state_dict().items():
        size = t.numel() * t.element_size()
        if ".experts." in name:
            E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            touched = E * (1 - (1 - k / E) ** tokens_per_step)
            size *= touched / E
        if name == "backbone.embeddings.weight":
            size = tokens_per_step * cfg.hidden_size * t.element_size()
        total += size
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict:
    from blockspec.engine import Engine

    model_path = args.model_path
    if model_path is None:
        model_path = str(write_random_model(args.random_config, Path(tempfile.mkdtemp())))
    if args.random_draft:
        args.speculative_algorithm = args.random_draft.upper()
        args.speculative_draft_model_path = str(write_random_draft(
            args.random_draft, Path(model_path), args.speculative_num_draft_tokens or 4))
    kw = {k: getattr(args, k) for k in ("device", "dtype", "speculative_algorithm",
                                         "speculative_draft_model_path",
                                         "speculative_num_draft_tokens") if getattr(args, k) is not None}
    engine = Engine(model_path=model_path, max_running_requests=max(args.batch_size, 1),
                    max_total_tokens=args.batch_size * (args.input_len + args.output_len + 64), **kw)
    g = torch.Generator().manual_seed(0)
    vocab = engine.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.batch_size)]
    sp = {"max_new_tokens": args.output_len, "temperature": args.temperature, "ignore_eos": True}

    def timed(params: dict) -> tuple[float, list[dict]]:
        _sync(engine.device)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        _sync(engine.device)
        return time.perf_counter() - t0, outs

    timed(sp)                                             # warm-up (allocations, kernels)
    prefill = statistics.median(timed({**sp, "max_new_tokens": 1})[0] for _ in range(args.repeats))
    runs = [timed(sp) for _ in range(args.repeats)]
    total = statistics.median(r[0] for r in runs)
    outs = runs[0][1]
    decode = max(total - prefill, 1e-9)
    new_tokens = sum(len(o["output_ids"]) for o in outs) - len(outs)     # first token is prefill's
    spec = engine.drafter is not None
    if spec:
        steps = max(o["meta_info"]["spec_verify_ct"] for o in outs)
        width = engine.drafter.gamma + 1
        tau = statistics.mean(o["meta_info"]["spec_accept_length"] for o in outs)
    else:
        steps, width, tau = args.output_len - 1, 1, 1.0
    step_s = decode / max(steps, 1)
    weight_bytes = step_weight_bytes(engine.model, args.batch_size * width)
    result = {
        "model": model_path if args.model_path else f"random:{args.random_config}",
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
        "dtype": str(engine.dtype), "batch_size": args.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "speculative": args.speculative_algorithm,
        "verify_width": width, "accept_length": round(tau, 3),
        "prefill_s": round(prefill, 4), "decode_s": round(decode, 4),
        "decode_tok_per_s": round(new_tokens / decode, 2),
        "tok_per_s_per_seq": round(new_tokens / decode / args.batch_size, 2),
        "step_ms": float(f"{step_s * 1e3:.4g}"), "weight_bytes_per_step": int(weight_bytes),
        "achieved_GBps": float(f"{weight_bytes / step_s / 1e9:.4g}"),
        "floor_step_ms_at_4.8TBps": float(f"{weight_bytes / H200_BW * 1e3:.4g}"),
    }
    engine.shutdown()
    return result


def main(args: argparse.Namespace) -> int:
    result = run(args)
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0
