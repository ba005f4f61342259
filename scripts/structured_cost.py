"""What a grammar costs a step: host microseconds of xgrammar's mask fill and of the verify
walk (fill + accept per draft, then rollback), the device-side mask, and decode tok/s and ms
per step of the demo family (greedy, one prompt) at two batch sizes: without a grammar, with
a grammar that allows every byte (the same tokens and acceptance: the masking's own cost) and
with a JSON schema (what a user sees: the drafts rarely guess the JSON).

    PYTHONPATH=. python scripts/structured_cost.py [--device cpu|cuda] [--algos NONE,DFLASH]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from blockspec import Engine
from blockspec.demo_family import EXAMPLE_QUESTION
from blockspec.grammar import bitmask_words, mask_logits
from blockspec.sampling import SamplingParams

SCHEMA = {"type": "object", "required": ["answer", "unit", "steps"], "properties": {
    "answer": {"type": "integer", "minimum": 0, "maximum": 100000},
    "unit": {"enum": ["pages", "days"]},
    "steps": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}}}}


def host_costs(engine: Engine, width: int) -> dict:
    comp = engine._grammars
    m = comp.matcher("json_schema", json.dumps(SCHEMA))
    prefix = engine.tokenizer.encode('{"answer": 147, "unit": "pages", "steps": ["Diego reads')
    for t in prefix:
        m.accept(t)
    rows = torch.zeros(width, bitmask_words(comp.vocab_size), dtype=torch.int32)
    drafts = engine.tokenizer.encode(" 60 pages a day")[: width - 1]
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        m.fill(rows[:1])
    one = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        m.fill(rows, drafts)
    walk = (time.perf_counter() - t0) / n * 1e6
    return {"fill_one_row_us": round(one, 1), f"walk_{width}_rows_us": round(walk, 1)}


def device_mask_us(device: str, rows: int, vocab: int) -> float:
    logits = torch.randn(rows, vocab, device=device)
    mask = torch.full((rows, bitmask_words(vocab)), -1, dtype=torch.int32, device=device)
    for _ in range(3):
        mask_logits(logits, mask)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(50):
        mask_logits(logits, mask)
    sync()
    return (time.perf_counter() - t0) / 50 * 1e6


ALLOW_ALL = {"ebnf": "root ::= [^\\x00]*"}


def decode_rate(engine: Engine, prompt: str, batch: int, grammar: dict) -> dict:
    """tok/s, ms per engine step (prefill steps included) and the accept length."""
    sp = {"max_new_tokens": 64, "temperature": 0, **grammar}
    engine.generate(prompt=[prompt] * batch, sampling_params=sp)          # warm (graphs, cache)
    steps = engine.stats().steps
    t0 = time.perf_counter()
    outs = engine.generate(prompt=[prompt] * batch, sampling_params=sp)
    dt = time.perf_counter() - t0
    steps = engine.stats().steps - steps
    toks = sum(len(o["output_ids"]) for o in outs)
    return {"tok_s": round(toks / dt, 1), "ms_step": round(dt / steps * 1e3, 2),
            "accept": round(outs[0]["meta_info"].get("spec_accept_length", 1.0), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--algos", default="NONE,DFLASH")
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    for algo in args.algos.split(","):
        e = Engine(device=args.device, speculative_algorithm=algo)
        prompt = e.tokenizer.apply_chat_template([{"role": "user", "content": EXAMPLE_QUESTION}])
        row = {"algo": algo, "device": args.device}
        e.compile_grammar(SamplingParams(json_schema=SCHEMA))
        row.update(host_costs(e, max(e.verify_width, 1)))
        for b in map(int, args.batches.split(",")):
            row[f"bs{b}"] = decode_rate(e, prompt, b, {})
            row[f"bs{b}_allow_all"] = decode_rate(e, prompt, b, ALLOW_ALL)
            row[f"bs{b}_schema"] = decode_rate(e, prompt, b, {"json_schema": SCHEMA})
        print(json.dumps(row), flush=True)
        e.shutdown()
    for vocab in (1024, 131072):
        print(json.dumps({"mask_logits_us": round(device_mask_us(args.device, 16 * 8, vocab), 1),
                          "rows": 128, "vocab": vocab, "device": args.device}), flush=True)


if __name__ == "__main__":
    main()
