"""Command line: ``blockspec generate | quantize | bench | serve``. Flags are EngineArgs fields
with dashes. Errors print one line and exit non-zero (no traceback)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from blockspec.args import EngineArgs

SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    for f in fields(EngineArgs):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = int if f.type in ("int", "int | None") else str
        p.add_argument(flag, type=kind, default=argparse.SUPPRESS)


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="blockspec", description="Nemotron-H inference with DFlash/DSpark")
    sub = top.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from one prompt")
    g.add_argument("prompt_pos", nargs="?", metavar="PROMPT")
    g.add_argument("--prompt")
    g.add_argument("--input-ids", help="comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--return-logprob", action="store_true")
    g.add_argument("--json", action="store_true", help="print the result dict as JSON")
    _engine_flags(g)
    b = sub.add_parser("bench", help="decode benchmark: tok/s, step time, achieved GB/s")
    from blockspec.bench.engine_bench import add_arguments

    add_arguments(b)
    q = sub.add_parser("quantize", help="write a ModelOpt-format quantized checkpoint")
    q.add_argument("--model-path", required=True)
    q.add_argument("--output", required=True)
    q.add_argument("--quant-algo", required=True,
                   choices=["W4A16_NVFP4", "NVFP4", "FP8", "MIXED_PRECISION"])
    q.add_argument("--recipe", choices=["lightning"])
    from blockspec.server.args import add_serve_parser

    add_serve_parser(sub, _engine_flags)
    return top


def _generate(ns: argparse.Namespace) -> int:
    from blockspec.engine import Engine

    texts = [t for t in (ns.prompt_pos, ns.prompt) if t is not None]
    if len(texts) + (ns.input_ids is not None) != 1:
        raise ValueError("give exactly one of PROMPT, --prompt or --input-ids")
    engine_kwargs = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)
                     if f.name != "extra" and hasattr(ns, f.name)}
    sp = {k: getattr(ns, k) for k in SAMPLING_FLAGS if getattr(ns, k) is not None}
    sp["ignore_eos"] = ns.ignore_eos
    engine = Engine(**engine_kwargs)
    try:
        if ns.input_ids is not None:
            try:
                ids = [int(x) for x in ns.input_ids.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"--input-ids must be comma-separated integers, got {ns.input_ids!r}") from None
            out = engine.generate(input_ids=ids, sampling_params=sp, return_logprob=ns.return_logprob)
        else:
            out = engine.generate(prompt=texts[0], sampling_params=sp, return_logprob=ns.return_logprob)
    finally:
        engine.shutdown()
    if ns.json:
        print(json.dumps(out, indent=1))
    else:
        print(out["text"] if engine.tokenizer is not None or out["text"] else out["output_ids"])
    return 0


def _quantize(ns: argparse.Namespace) -> int:
    from blockspec.quant.quantize import quantize_checkpoint

    report = quantize_checkpoint(ns.model_path, ns.output, ns.quant_algo, recipe=ns.recipe)
    for notice in getattr(report, "notices", []):
        print(f"notice: {notice}", file=sys.stderr)
    print(f"wrote {ns.quant_algo} checkpoint to {ns.output}")
    return 0


def _bench(ns: argparse.Namespace) -> int:
    from blockspec.bench.engine_bench import main as bench_main

    return bench_main(ns)


def _serve(ns: argparse.Namespace) -> int:
    from blockspec.server.launch import run

    return run(ns)


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        return {"generate": _generate, "quantize": _quantize, "bench": _bench,
                "serve": _serve}[ns.command](ns)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        print(f"blockspec {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
