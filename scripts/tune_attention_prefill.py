"""Launch-config sweep of the paged attention kernel on prefill chunks, Lightning's shapes.

    python scripts/tune_attention_prefill.py --out attn.jsonl           # one GPU, ~3 minutes
    TRITON_INTERPRET=1 python scripts/tune_attention_prefill.py --smoke --out s.jsonl   # CPU

Why: at 64k tokens and beyond, causal attention over the growing context is the largest part
of a prefill (about half of a 131k prompt's time to first token at ~230 TFLOP/s), and the
kernel's prefill tiles (``PREFILL_CONFIG`` in ``blockspec/kernels/paged_attention.py``) were
never tuned. Shape: one request, GQA 32 query / 2 KV heads of 128, pages of 16 (shuffled),
bf16; a chunk of ``--chunk`` queries after ``--context`` cached tokens, causal. For each
(chunk, context) every candidate (tile height x key block x warps x stages x unmasked full blocks) is checked once
against the current ``PREFILL_CONFIG``'s output (max |diff| <= 2e-2 x max |out|), then timed
with CUDA events (median of ``--reps`` after warm-up). One JSON line per point in ``--out``;
at the end the best per shape and the ``PREFILL_CONFIG`` that is best summed over the shapes.
``--flashinfer`` adds one point per shape for flashinfer's paged prefill
(``BatchPrefillWithPagedKVCacheWrapper``, causal, NHD pages: the same cache seen as
[pages, page, Hkv, D]), checked and timed the same way; flashinfer is not a dependency
(``pip install flashinfer-python``; offline, its wheel and apache-tvm-ffi's installed with
``--no-index``; its first call JIT-compiles for about 90 s).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.bench.timing import event_time_ms
from blockspec.kernels import paged_attention as pa

HQ, HKV, D, PAGE = 32, 2, 128, 16
# 256-row tiles hold 16 queries of a 16-head GQA group: each K/V row read feeds four times
# the math of today's 64-row tiles (at 64k context a prefill chunk streams K/V at HBM rates)
# the likeliest winners first (the last key varies fastest): a --budget-s cut drops the tail
GRID = {"block_m": (128, 256, 64), "block_n": (64, 128, 32), "num_warps": (8, 4),
        "num_stages": (3, 2), "full_blocks": (True, False)}
SMOKE = dict(hq=4, hkv=2, d=16, chunks=(24,), contexts=(8, 40))


def inputs(chunk: int, context: int, hq: int, hkv: int, d: int, device: torch.device,
           dtype: torch.dtype, seed: int = 0) -> dict:
    """q of the chunk, a KV cache holding context + chunk tokens on shuffled pages, and the
    table rows of one request."""
    g = torch.Generator().manual_seed(seed)
    total = context + chunk
    pages = -(-total // PAGE) + 1
    perm = torch.randperm(pages + 2, generator=g)[:pages]
    table = torch.zeros(2, pages, dtype=torch.int32)
    table[0] = perm.to(torch.int32)
    slots = (pages + 2) * PAGE
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    q = torch.randn(chunk, hq, d, generator=g).to(dtype)
    to = {"device": device}
    return {"q": q.to(**to), "k": k.to(**to), "v": v.to(**to), "table": table.to(**to),
            "slots": torch.zeros(1, dtype=torch.long, device=device),
            "seq": torch.tensor([total], device=device),
            "qst": torch.tensor([0, chunk], device=device)}


def run(x: dict, group: int, cfg: dict) -> torch.Tensor:
    tr, t0 = pa.ragged_tiles([x["q"].shape[0]], group, cfg["block_m"], x["q"].device)
    return pa.paged_attention(x["q"], x["k"], x["v"], x["table"], x["slots"], x["seq"],
                              x["qst"], tr, t0, page_size=PAGE, scale=D ** -0.5, causal=True,
                              **cfg)


def flashinfer_run(x: dict, hq: int, hkv: int, d: int):
    """(a callable running flashinfer's paged causal prefill over ``x``, planned once; the
    backend flashinfer chose)."""
    import flashinfer  # lazy: optional, GPU only

    q, dev = x["q"], x["q"].device
    pages = x["table"][0].to(torch.int32)
    total = int(x["seq"][0])
    used = -(-total // PAGE)
    work = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(work, "NHD")
    wrapper.plan(torch.tensor([0, q.shape[0]], dtype=torch.int32),
                 torch.tensor([0, used], dtype=torch.int32), pages[:used].contiguous(),
                 torch.tensor([total - (used - 1) * PAGE], dtype=torch.int32),
                 hq, hkv, d, PAGE, causal=True, sm_scale=d ** -0.5, q_data_type=q.dtype,
                 kv_data_type=x["k"].dtype)
    kv = (x["k"].view(-1, PAGE, hkv, d), x["v"].view(-1, PAGE, hkv, d))
    return (lambda: wrapper.run(q, kv)), getattr(wrapper, "_backend", "auto")


def causal_flops(chunk: int, context: int, hq: int, d: int) -> float:
    """QK^T and PV over the keys each query sees: sum over i of (context + i + 1) keys."""
    keys = chunk * context + chunk * (chunk + 1) / 2
    return 4.0 * keys * hq * d


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--chunk", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--context", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=270.0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the interpreter's check)")
    p.add_argument("--flashinfer", action="store_true",
                   help="also time flashinfer's paged prefill on each shape")
    p.add_argument("--no-grid", action="store_true",
                   help="time only the current PREFILL_CONFIG (and flashinfer with --flashinfer)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    hq, hkv, d = (SMOKE["hq"], SMOKE["hkv"], SMOKE["d"]) if args.smoke else (HQ, HKV, D)
    chunks = SMOKE["chunks"] if args.smoke else args.chunk
    contexts = SMOKE["contexts"] if args.smoke else args.context
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    grid = [dict(zip(GRID, vals)) for vals in itertools.product(*GRID.values())]
    if args.smoke:
        grid = [c for c in grid if c["num_stages"] == 2 and c["num_warps"] == 4]
    if args.no_grid:
        grid = [{k: pa.PREFILL_CONFIG[k] for k in GRID}]
    end = time.monotonic() + args.budget_s
    records, base_cfg = [], dict(pa.PREFILL_CONFIG)
    with open(args.out, "a") as f:
        for chunk, context in itertools.product(chunks, contexts):
            x = inputs(chunk, context, hq, hkv, d, device, dtype)
            want = run(x, hq // hkv, base_cfg).float()
            scale = float(want.abs().max()) or 1.0
            flops = causal_flops(chunk, context, hq, d)
            for cfg in grid:
                rec = {"chunk": chunk, "context": context, **cfg}
                if time.monotonic() > end:
                    rec["status"] = "skipped"
                else:
                    try:
                        got = run(x, hq // hkv, cfg).float()
                        err = float((got - want).abs().max()) / scale
                        if err > 2e-2:
                            rec.update(status="mismatch", err=err)
                        else:
                            ms = event_time_ms(lambda cfg=cfg: run(x, hq // hkv, cfg), args.reps,
                                               device)
                            rec.update(status="ok", err=err, ms=ms,
                                       tflops=flops / (ms * 1e-3) / 1e12)
                    except Exception as e:     # a config the compiler refuses (shared memory)
                        rec.update(status="failed", error=f"{type(e).__name__}: {e}"[:200])
                records.append(rec)
                f.write(json.dumps(rec) + "\n")
                f.flush()
            if args.flashinfer:
                rec = {"chunk": chunk, "context": context, "impl": "flashinfer"}
                try:
                    fn, rec["backend"] = flashinfer_run(x, hq, hkv, d)
                    err = float((fn().float() - want).abs().max()) / scale
                    ms = event_time_ms(fn, args.reps, device)
                    rec.update(status="ok" if err <= 2e-2 else "mismatch", err=err, ms=ms,
                               tflops=flops / (ms * 1e-3) / 1e12)
                except Exception as e:    # not installed, or its JIT failed
                    rec.update(status="failed", error=f"{type(e).__name__}: {e}"[:300])
                    print(f"flashinfer failed: {type(e).__name__}: {str(e)[-3000:]}",
                          file=sys.stderr, flush=True)
                print(json.dumps(rec), flush=True)
                f.write(json.dumps(rec) + "\n")
                f.flush()
    ok = [r for r in records if r["status"] == "ok"]
    for chunk, context in itertools.product(chunks, contexts):
        here = [r for r in ok if r["chunk"] == chunk and r["context"] == context]
        if not here:
            continue
        best = min(here, key=lambda r: r["ms"])
        base = next((r for r in here if all(r[k] == base_cfg[k] for k in GRID)), None)
        print(f"chunk {chunk} context {context}: best {best['ms']:.3f} ms "
              f"({best['tflops']:.0f} TFLOP/s) {[best[k] for k in GRID]}; current "
              + (f"{base['ms']:.3f} ms ({base['tflops']:.0f} TFLOP/s)" if base else "not timed"))
    shapes = {(r["chunk"], r["context"]) for r in ok}
    totals = {}
    for r in ok:
        key = tuple(r[k] for k in GRID)
        totals.setdefault(key, {})[(r["chunk"], r["context"])] = r["ms"]
    full = {k: sum(v.values()) for k, v in totals.items() if set(v) == shapes}
    if full:
        key = min(full, key=full.get)
        print("PREFILL_CONFIG =", json.dumps(dict(zip(GRID, key))),
              f"# {full[key]:.2f} ms over the shapes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
