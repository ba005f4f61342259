"""``blockspec train-target``: train the demo family's Nemotron-H target on GSM8K-format data.

One command does the whole target: read (or generate) the train split, train a tokenizer if
the output has none, build the model (``--size demo`` ≈ 6.5M parameters over all four layer
kinds; ``--size tiny`` for smoke tests), train it for ``--time-budget-s`` seconds, and write a
transformers-layout checkpoint (bf16) with the tokenizer beside it.  ``--resume`` continues a
run from its ``train_state.pt``; a checkpoint is written every ``--save-every-s`` seconds and at
the end.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenizers import Tokenizer

from blockspec.gsm8k_data.generator import generate_split, read_jsonl
from blockspec.gsm8k_data.tokenizer import save_tokenizer, train_tokenizer, training_texts

SIZES = {
    # every layer kind: Mamba-2 M, attention *, relu² MLP -, MoE E
    "demo": dict(pattern="M*-M*EM*-M*E", sizes={}),
    "tiny": dict(pattern="M*-E", sizes=dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
        n_groups=2, chunk_size=16, n_routed_experts=4, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32)),
}
MAX_LEN = 256


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train-target", help="train the demo Nemotron-H target on GSM8K-format data")
    p.add_argument("--output", required=True, help="checkpoint folder to write")
    p.add_argument("--data", help="train jsonl (default: generate --num-samples problems)")
    p.add_argument("--num-samples", type=int, default=300_000,
                   help="problems generated when --data is not given")
    p.add_argument("--tokenizer", help="folder with tokenizer.json (default: train one)")
    p.add_argument("--size", choices=sorted(SIZES), default="demo",
                   help="model size: demo (~6.5M parameters) or tiny (tests)")
    p.add_argument("--time-budget-s", type=float, default=240.0,
                   help="seconds of training; the learning-rate schedule spans them")
    p.add_argument("--max-steps", type=int, help="stop after this many steps (tests)")
    p.add_argument("--batch-size", type=int, default=256, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--save-every-s", type=float, default=120.0,
                   help="seconds between checkpoints (resume state included)")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation and data order")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUTPUT/train_state.pt; --time-budget-s is the total")
    p.add_argument("--init-from", help="start from this checkpoint's weights (same config; "
                                       "a fresh optimizer), e.g. to train a shipped target longer")
    p.set_defaults(handler=main)
    return p


def _rows(ns: argparse.Namespace) -> list[dict]:
    if ns.data:
        rows = read_jsonl(ns.data)
        return rows[: ns.num_samples] if ns.num_samples else rows
    return [p.to_json() for p in generate_split("train", ns.num_samples, ns.seed)]


def _tokenizer(ns: argparse.Namespace, out: Path, rows: list[dict]):
    src = Path(ns.tokenizer or ns.init_from or out)
    if (src / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
        if src != out:
            out.mkdir(parents=True, exist_ok=True)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if (src / name).is_file():
                    (out / name).write_bytes((src / name).read_bytes())
        return tok
    tok = train_tokenizer(training_texts(rows[:20_000]))
    save_tokenizer(tok, out)
    return tok


def _init_from(model, cfg: dict, folder: Path) -> None:
    # lazy: torch loads only when the command runs (``--help`` stays instant)
    import torch

    from blockspec.checkpoint import TensorSource, load_state, read_config

    other = {k: v for k, v in read_config(folder).items() if k != "dtype"}
    if other != {k: v for k, v in cfg.items() if k != "dtype"}:
        raise ValueError(f"--init-from {folder}: its config.json differs from the model being "
                         f"trained (same --size and tokenizer needed)")
    with TensorSource(folder) as src, torch.no_grad():
        load_state(model, src, what=f"--init-from {folder.name}")


def main(ns: argparse.Namespace) -> int:
    # lazy: torch and the models load only when the command runs (``--help`` stays instant)
    import torch
    import torch.nn.functional as F

    from blockspec.train.data import BatchOrder, encode_rows, pad_batch
    from blockspec.train.loop import (Budget, Reporter, adamw, autocast, configure_backends,
                                      lr_at, optimizer_step, pick_device, resume, save_state,
                                      set_lr)
    from blockspec.train.target_model import (RouterBalancer, build_target, forward_hidden,
                                              hf_config, save_target)

    t_start = time.monotonic()
    out = Path(ns.output)
    dev = pick_device(ns.device)
    configure_backends(dev)
    rows = _rows(ns)
    tok = _tokenizer(ns, out, rows)
    eos = tok.token_to_id("</s>")
    pad = tok.token_to_id("<pad>")
    seqs = encode_rows(tok, rows, eos, MAX_LEN)
    vocab = -(-tok.get_vocab_size() // 64) * 64
    spec = SIZES[ns.size]
    cfg = hf_config(spec["pattern"], vocab, **spec["sizes"])
    model = build_target(cfg, dev, ns.seed)
    n_params = sum(p.numel() for p in model.parameters())
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = adamw(params, ns.lr, ns.weight_decay, dev)
    budget = Budget(ns.time_budget_s, ns.max_steps)
    order = BatchOrder(seqs.lengths.tolist(), ns.batch_size, ns.seed)
    if ns.init_from:
        _init_from(model, cfg, Path(ns.init_from))
    if ns.resume:
        resume(out, cfg, "model", model, opt, order, budget)
    print(f"[train-target] {ns.size} pattern {spec['pattern']} vocab {vocab}: "
          f"{n_params / 1e6:.2f}M params; {len(seqs)} sequences; device {dev}; "
          f"setup {time.monotonic() - t_start:.1f}s", flush=True)

    balancer = RouterBalancer(model)
    report = Reporter("train-target", budget)

    def checkpoint() -> None:
        save_target(model, cfg, out)
        save_state(out, model=model.state_dict(), optimizer=opt.state_dict(), order=order.state(),
                   elapsed=budget.elapsed, step=budget.step, budget_s=budget.seconds, config=cfg)

    model.train()
    budget.start()
    last_save = time.monotonic()
    lr, loss = ns.lr, torch.tensor(float("nan"))
    while not budget.done:
        ids, lengths, starts = pad_batch(seqs, order.next(), pad)
        ids = ids.to(dev, non_blocking=True)
        pos = torch.arange(ids.shape[1])[None]
        # predict token t+1 from rows starting at the newline before the answer
        mask = (pos >= (starts[:, None] - 1)) & (pos < (lengths[:, None] - 1))
        mask = mask.to(dev)
        lr = lr_at(budget.progress, ns.lr)
        set_lr(opt, lr)
        with autocast(dev):
            h = forward_hidden(model, ids)
            logits = model.compute_logits(h[:, :-1][mask[:, :-1]])
        loss = F.cross_entropy(logits.float(), ids[:, 1:][mask[:, :-1]])
        stepped = optimizer_step(opt, model, loss)
        balancer.step()
        budget.tick()
        report.update(float(loss.detach()), int(lengths.sum()), lr, stepped)
        if time.monotonic() - last_save >= ns.save_every_s:
            checkpoint()
            last_save = time.monotonic()
    report.flush(lr)
    report.close()
    balancer.close()
    checkpoint()
    summary = {"output": str(out), "params": n_params, "steps": budget.step,
               "train_seconds": round(budget.elapsed, 1), "final_loss": round(float(loss.detach()), 4),
               "skipped_steps": report.skipped, "device": str(dev)}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[train-target] done: {json.dumps(summary)}", flush=True)
    return 0

