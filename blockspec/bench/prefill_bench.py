"""Prefill benchmark: time to first token, prefill tok/s and the compute floor.

    blockspec bench --prefill --input-len 1024,4096,16384 [--preset P [--quantized] |
        --model-path P] [--chunked-prefill-size N[,N...]] [--breakdown]

One engine (built as the decode bench builds it) serves every length. Per length, at batch 1:
a warm-up prefill, then the median of ``--repeats`` timed ``max_new_tokens=1`` requests, each
on fresh random prompt tokens. TTFT is the wall time of that request (prefill forwards, the
first token's sampling and the engine's own overhead; the device is synchronized around it).

The floor: FLOPs of the prefill from the config (``bench/flops.py``) over a bf16 matmul rate
measured in the same run on the same device (8192^3 bf16 on CUDA; on CPU, a smoke test, a
256^3 one in the model's dtype). Every
matmul is counted at that rate, the quantized ones too (W4A16 experts compute in bf16; the
FP8 Mamba projections could run faster, so a quantized floor is slightly pessimistic).
``--breakdown`` adds one line per length splitting a prefill by layer kind
(``bench/prefill_breakdown.py``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from blockspec.bench.bench_args import with_lengths
from blockspec.bench.engine_bench import build_engine
from blockspec.bench.flops import prefill_flops
from blockspec.bench.jsonl import append_rows
from blockspec.bench.prefill_breakdown import breakdown, format_table
from blockspec.bench.timing import event_time_ms, timed_generate


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None,
                  reps: int = 10) -> tuple[float, int]:
    """Measured TFLOP/s of an n x n x n ``torch.matmul`` in ``dtype`` (median of ``reps``)
    and n; n defaults to 8192 on CUDA and 256 on CPU."""
    n = n or (8192 if device.type == "cuda" else 256)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    ms = event_time_ms(lambda: torch.matmul(a, b), reps, device)
    return 2 * n ** 3 / (ms / 1e3) / 1e12, n


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def time_to_first_token(engine, input_len: int, repeats: int) -> float:
    """Median wall seconds of ``repeats`` batch-1 ``max_new_tokens=1`` requests, after one
    warm-up; a new prompt every time."""
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    vocab = engine.config.vocab_size
    times = []
    for r in range(repeats + 1):
        s, _ = timed_generate(engine, [_prompt(vocab, input_len, seed=1000 * input_len + r)], sp)
        if r:                                           # r == 0 is the warm-up
            times.append(s)
    return statistics.median(times)


def prefill_row(input_len: int, ttft: float, flops: dict[str, int], tflops: float) -> dict:
    """The measured and floor figures of one length (consistent by construction:
    tok/s x ttft = input_len; pct_of_floor = 100 x measured tok/s / floor tok/s)."""
    floor_s = flops["total"] / (tflops * 1e12)
    return {
        "input_len": input_len, "ttft_s": ttft,
        "prefill_tok_per_s": input_len / ttft,
        "flops": flops["total"], "flops_per_token": flops["total"] / input_len,
        "flops_by_part": {k: v for k, v in flops.items() if k != "total"},
        "floor_s": floor_s, "floor_tok_per_s": input_len / floor_s,
        "pct_of_floor": 100 * floor_s / ttft,
    }


def input_lengths(args: argparse.Namespace) -> list[int]:
    lens = args.input_len if isinstance(args.input_len, list) else [args.input_len]
    if not lens or min(lens) < 1:
        raise ValueError(f"--input-len must be lengths >= 1, got {args.input_len!r}")
    return lens


def run(args: argparse.Namespace) -> list[dict]:
    args = with_lengths(args)
    lens = input_lengths(args)
    if args.random_draft or args.speculative_algorithm:
        raise ValueError("--prefill measures the target's prefill; drop --random-draft / "
                         "--speculative-algorithm")
    if args.batch_size not in (None, [1], 1):
        raise ValueError("--prefill runs at batch 1; drop --batch-size")
    sized = argparse.Namespace(**{**vars(args), "input_len": max(lens), "output_len": 1})
    engine, label = build_engine(sized, 1)
    try:
        # the floor is the bf16 tensor-core rate on CUDA; a CPU smoke run uses the model's dtype
        # (CPU bf16 matmuls are emulated, far slower than the fp32 the tiny model runs in)
        mm_dtype = torch.bfloat16 if engine.device.type == "cuda" else engine.dtype
        tflops, n = matmul_tflops(engine.device, mm_dtype)
        sizes = args.chunked_prefill_size
        chunks = sizes if isinstance(sizes, list) else [engine.args.chunked_prefill_size]
        base = {
            "bench": "prefill", "model": label,
            "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
            "dtype": str(engine.dtype).split(".")[-1], "quantized": bool(args.quantized),
            "batch_size": 1, "repeats": args.repeats,
            "matmul_tflops": tflops, "matmul_n": n, "matmul_dtype": str(mm_dtype).split(".")[-1],
            "attention_backend": engine.backends.prefill,
        }
        results = []
        for chunk, L in ((c, L) for c in chunks for L in lens):
            engine.scheduler.chunk = chunk
            at = {**base, "chunked_prefill_size": chunk}
            ttft = time_to_first_token(engine, L, args.repeats)
            flops = prefill_flops(engine.config, L, chunk)
            row = {**at, **prefill_row(L, ttft, flops, tflops)}
            results.append(row)
            print(json.dumps(_rounded(row)), flush=True)
            if args.breakdown:
                prompt = _prompt(engine.config.vocab_size, L, seed=L)
                parts = {**at, **breakdown(engine, L, prompt, flops)}
                print(format_table(parts), file=sys.stderr, flush=True)
                results.append(parts)
                print(json.dumps(_rounded(parts)), flush=True)
    finally:
        engine.shutdown()
    return results


def _rounded(row: dict) -> dict:
    """The row with floats to 4 significant digits, for printing (tests read the exact row)."""
    def r(v):
        if isinstance(v, float):
            return float(f"{v:.4g}")
        return {k: r(x) for k, x in v.items()} if isinstance(v, dict) else v
    return r(row)


def main(args: argparse.Namespace) -> int:
    results = run(args)
    append_rows(args.out, [_rounded(row) for row in results])
    return 0
