"""``blockspec train-draft``: train a DFlash or DSpark draft against a trained target.

The target is loaded by blockspec's own ``Engine`` and frozen; its features come from
``ModelRunner.hidden_states`` -- the aux capture serving uses, at the same taps (draft layer id
t is captured before target layer t+1).  The draft is blockspec's own ``DFlashDraftModel`` /
``DSparkDraftModel``, trained with the objective in ``draft_objective`` and written by
``draft_export`` in the layout serving loads.  Time-budgeted, resumable, CPU or CUDA.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from blockspec.gsm8k_data.generator import generate_split, read_jsonl

MAX_LEN = 256


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train-draft", help="train a DFlash/DSpark draft for a target")
    p.add_argument("--target-model-path", required=True, help="the target the draft serves")
    p.add_argument("--algorithm", required=True, type=str.lower, choices=["dflash", "dspark"],
                   help="draft kind")
    p.add_argument("--output", required=True, help="draft checkpoint folder to write")
    p.add_argument("--block-size", type=int,
                   help="DFlash block B (default 8) or DSpark gamma (default 7); verify width "
                        "is B or gamma+1")
    p.add_argument("--markov-rank", type=int, default=64, help="DSpark Markov head rank")
    p.add_argument("--layout", choices=["generic", "nemotron35"], default="generic",
                   help="checkpoint layout: generic (target embedding) or Nemotron 3.5 (own "
                        "embed_tokens, aux ids = target ids + 1)")
    p.add_argument("--quantize", choices=["W4A16_NVFP4"],
                   help="pack the trained draft (the Nemotron-3.5 layout needs W4A16_NVFP4)")
    p.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")],
                   help="comma-separated target layers to condition on (default: 3 spread "
                        "from layer 1 to the last)")
    p.add_argument("--size", choices=["demo", "tiny"], default="demo",
                   help="draft size: demo or tiny (tests)")
    p.add_argument("--data", help="GSM8K-format train jsonl (default: generated train split)")
    p.add_argument("--num-samples", type=int, default=100_000,
                   help="problems used (generated when --data is not given)")
    p.add_argument("--num-anchors", type=int, default=32, help="blocks per sequence per step")
    p.add_argument("--loss-decay-gamma", type=float,
                   help="decay of the per-position loss weight (default 7/5/4 for verify "
                        "width 16/10/8)")
    p.add_argument("--time-budget-s", type=float, default=40.0, help="seconds of training")
    p.add_argument("--max-steps", type=int, help="stop after this many steps (tests); default: none")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--save-every-s", type=float, default=60.0, help="seconds between checkpoints")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation, anchors and data order")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT/train_state.pt")
    p.set_defaults(handler=main)
    return p


def _rows(ns: argparse.Namespace) -> list[dict]:
    if ns.data:
        return read_jsonl(ns.data)[: ns.num_samples]
    return [p.to_json() for p in generate_split("train", ns.num_samples, ns.seed + 1)]


def build(ns: argparse.Namespace, target_cfg: dict, mask_id: int, device):
    """(draft config dict, parsed config, trainable fp32 draft module)."""
    # lazy: torch and the models load only when the command runs (``--help`` stays instant)
    import torch

    from blockspec.models.draft import build_draft_model
    from blockspec.configs.draft import parse_draft_config
    from blockspec.train.draft_layout import default_target_layer_ids, draft_config

    if ns.layout == "nemotron35" and ns.quantize is None:
        raise ValueError("--layout nemotron35 is defined by W4A16_NVFP4 weights (one of the "
                         "layout's five conditions); pass --quantize W4A16_NVFP4")
    num_layers = len(target_cfg.get("layers_block_type") or target_cfg["hybrid_override_pattern"])
    block = ns.block_size or (8 if ns.algorithm == "dflash" else 7)
    ids = ns.target_layer_ids or default_target_layer_ids(num_layers)
    cfg_dict = draft_config(target_cfg, algorithm=ns.algorithm, layout=ns.layout, block_size=block,
                            mask_token_id=mask_id, target_layer_ids=ids, size=ns.size,
                            markov_rank=ns.markov_rank, quantized=ns.quantize is not None)
    cfg = parse_draft_config(cfg_dict)
    impl = "sdpa" if device.type == "cuda" else "eager"
    with torch.device(device):
        draft = build_draft_model(cfg, None, torch.float32, attn_impl=impl)
    draft.init_random_(std=0.02, generator=torch.Generator().manual_seed(ns.seed))
    draft.requires_grad_(True)
    return cfg_dict, cfg, draft


def main(ns: argparse.Namespace) -> int:
    # lazy: torch and the engine load only when the command runs (``--help`` stays instant)
    import torch
    from tokenizers import Tokenizer

    from blockspec.checkpoint import read_config
    from blockspec.engine import Engine
    from blockspec.train.data import BatchOrder, encode_rows, pad_batch
    from blockspec.train.draft_export import save_draft
    from blockspec.train.draft_layout import decay_gamma
    from blockspec.train.draft_objective import draft_loss, sample_anchors
    from blockspec.train.loop import (Budget, Reporter, adamw, autocast, configure_backends,
                                      lr_at, optimizer_step, pick_device, resume, save_state,
                                      set_lr)

    t_start = time.monotonic()
    out = Path(ns.output)
    dev = pick_device(ns.device)
    configure_backends(dev)
    target_path = Path(ns.target_model_path)
    target_cfg = read_config(target_path)
    if not (target_path / "tokenizer.json").is_file():
        raise ValueError(f"--target-model-path {target_path}: no tokenizer.json (the training "
                         f"text is tokenized with the target's tokenizer)")
    tok = Tokenizer.from_file(str(target_path / "tokenizer.json"))
    mask_id = tok.token_to_id("<|mask|>")
    if mask_id is None:
        mask_id = target_cfg["vocab_size"] - 1   # an id the tokenizer never produces
    eos = tok.token_to_id("</s>")
    eos = eos if eos is not None else target_cfg["eos_token_id"]
    pad = tok.token_to_id("<pad>") or 0
    seqs = encode_rows(tok, _rows(ns), eos, MAX_LEN)
    engine = Engine(model_path=str(target_path), device=str(dev),
                    max_running_requests=ns.batch_size,
                    max_total_tokens=ns.batch_size * (MAX_LEN + 16))
    target, runner = engine.model, engine.runner
    target.requires_grad_(False)

    cfg_dict, cfg, draft = build(ns, target_cfg, mask_id, dev)
    taps = tuple(i + 1 for i in cfg.target_layer_ids)
    decay = ns.loss_decay_gamma or decay_gamma(cfg.gamma + 1)
    params = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    if cfg.is_nemotron_35:   # own embedding, initialised from the target's and trained
        draft.embed_tokens.weight.data.copy_(target.backbone.embeddings.weight.float())
    opt = adamw(params, ns.lr, ns.weight_decay, dev)
    budget = Budget(ns.time_budget_s, ns.max_steps)
    order = BatchOrder(seqs.lengths.tolist(), ns.batch_size, ns.seed)
    gen = torch.Generator().manual_seed(ns.seed)
    if ns.resume:
        gen.set_state(resume(out, cfg_dict, "draft", draft, opt, order, budget)["anchor_rng"])
    n_params = sum(p.numel() for _, p in params)
    print(f"[train-draft] {ns.algorithm} {ns.layout} verify width {cfg.gamma + 1} "
          f"(gamma {cfg.gamma}, {cfg.query_len} query rows), target layers "
          f"{cfg.target_layer_ids}, {n_params / 1e6:.2f}M params, decay {decay}, device {dev}; "
          f"setup {time.monotonic() - t_start:.1f}s", flush=True)

    report = Reporter(f"train-draft {ns.algorithm}", budget)

    def checkpoint() -> None:
        save_draft(draft, cfg_dict, out, ns.quantize)
        save_state(out, model=draft.state_dict(), optimizer=opt.state_dict(), order=order.state(),
                   anchor_rng=gen.get_state(), elapsed=budget.elapsed, step=budget.step,
                   config=cfg_dict)

    draft.train()
    budget.start()
    last_save = time.monotonic()
    lr, loss, stats = ns.lr, torch.tensor(float("nan")), {}
    while not budget.done:
        ids, lengths, starts = pad_batch(seqs, order.next(), pad)
        feats = torch.stack(runner.hidden_states(ids.tolist(), taps))   # [B, S, K*H]
        anchors, valid = sample_anchors(lengths, starts, ns.num_anchors, gen)
        ids, lengths, anchors, valid = (t.to(dev) for t in (ids, lengths, anchors, valid))
        lr = lr_at(budget.progress, ns.lr)
        set_lr(opt, lr)
        with autocast(dev):
            loss, stats = draft_loss(draft, target, feats, ids, lengths, anchors, valid, decay)
        stepped = optimizer_step(opt, draft, loss)
        budget.tick()
        report.update(float(loss.detach()), int(valid.sum()) * cfg.query_len, lr, stepped)
        if time.monotonic() - last_save >= ns.save_every_s:
            checkpoint()
            last_save = time.monotonic()
    report.flush(lr)
    report.close()
    checkpoint()
    summary = {"output": str(out), "algorithm": ns.algorithm, "layout": ns.layout,
               "quantize": ns.quantize, "verify_width": cfg.gamma + 1, "params": n_params,
               "steps": budget.step, "train_seconds": round(budget.elapsed, 1),
               "final_loss": round(float(loss.detach()), 4),
               "train_accept_length_estimate": round(stats.get("prefix", 0.0) + 1.0, 3),
               "skipped_steps": report.skipped, "device": str(dev)}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[train-draft] done: {json.dumps(summary)}", flush=True)
    engine.shutdown()
    return 0
