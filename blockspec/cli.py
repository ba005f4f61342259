"""Command line (``blockspec`` or ``python -m blockspec``). Subcommands:

  generate      text or token-id prompts (one, or several run as one batch) -> text or JSON
  serve         OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)
  bench         decode benchmark (tok/s, step time, achieved weight GB/s) or, with
                --prefill, TTFT and prefill tok/s against the compute floor; with
                --itl-under-prefill, running streams' ITL while a long prompt prefills;
                with --prefix-cache, a multi-turn or agentic workload with the cache on and off
  quantize      dense Nemotron-H folder -> ModelOpt-layout W4A16_NVFP4 / NVFP4 / FP8 / mixed folder
  train-target  train the demo Nemotron-H target on GSM8K-format data
  train-draft   train a DFlash / DSpark draft for a target
  eval gsm8k    GSM8K-format accuracy and speculative statistics

``generate``'s and ``serve``'s engine flags are the EngineArgs fields with dashes, their help
taken from the fields. Building the parser imports nothing heavy, so ``--help`` and argument
errors answer at once. Errors print one line and exit 2; Ctrl-C prints one line and exits 130."""
from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from blockspec import __version__
from blockspec.args import EngineArgs
from blockspec.bench.bench_args import add_arguments as bench_arguments
from blockspec.demo_family import demo_engine_kwargs, describe
from blockspec.eval.gsm8k import add_parser as add_eval
from blockspec.flags import HelpFormatter, canonical, engine_flags
from blockspec.progress import TokenProgress
from blockspec.server.args import add_serve_parser
from blockspec.train.draft import add_parser as add_train_draft
from blockspec.train.target import add_parser as add_train_target

SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                  "ignore_eos")
QUANT_ALGOS = ("W4A16_NVFP4", "NVFP4", "FP8", "MIXED_PRECISION")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:          # one line, like every other CLI error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """--version without importing torch (its version comes from the installed metadata)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print blockspec's, torch's and Python's versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        try:
            torch = version("torch")
        except PackageNotFoundError:
            torch = "not installed"
        print(f"blockspec {__version__} (torch {torch}, python {platform.python_version()})")
        parser.exit()


def _generate_flags(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompt_pos", nargs="?", metavar="PROMPT", help="prompt text (optional)")
    g.add_argument("--prompt", action="append", metavar="TEXT",
                   help="prompt text; repeat for several prompts, run as one batch")
    g.add_argument("--prompt-file", metavar="FILE",
                   help="one prompt per line (blank lines skipped; - reads stdin), run as one batch")
    g.add_argument("--input-ids", metavar="IDS", help="comma-separated token ids instead of text, "
                                                      "e.g. 1,2,3")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the tokenizer's chat template")
    s = g.add_argument_group("sampling (the API's sampling_params)")
    s.add_argument("--max-new-tokens", type=int, default=128,
                   help="most tokens generated per prompt (the API's default too)")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, 0 = greedy (default: 0.0 here; the API's "
                        "default is 1.0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept, in (0, 1]")
    s.add_argument("--top-k", type=int, default=-1, help="most likely tokens kept; -1 = off")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top "
                                                           "probability; 0 = off")
    s.add_argument("--seed", type=int, help="this request's own sampling seed; default: none, "
                                            "the seed is derived from --random-seed and the "
                                            "request's arrival order")
    s.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop string (repeatable); the text ends before it")
    s.add_argument("--stop-token-ids", metavar="IDS",
                   help="comma-separated token ids that end generation; default: none")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    o = g.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print the result as JSON (text, output_ids, meta_info); a list for "
                        "several prompts")
    o.add_argument("--return-logprob", action="store_true",
                   help="add output_token_logprobs to meta_info (see --json, --verbose)")
    o.add_argument("-v", "--verbose", action="store_true",
                   help="print meta_info (token counts, timing, speculative stats) to stderr and "
                        "show progress bars even when stderr is not a terminal")


def build_parser() -> argparse.ArgumentParser:
    top = _Parser(prog="blockspec", formatter_class=HelpFormatter,
                  description="Nemotron-H inference with DFlash/DSpark block speculative decoding")
    top.add_argument("--version", action=_Version)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=description,
                              formatter_class=HelpFormatter)

    g = command("generate", "generate from one or more prompts",
                "Generate from one or more prompts. Without --model-path the trained demo family "
                "shipped in the package is used (a small Nemotron-H that answers GSM8K-style math "
                "word problems), with DFLASH on: --speculative-algorithm DSPARK picks its DSpark "
                "draft, NONE turns speculation off. With speculation the accept length is printed "
                "on stderr. Sampling is greedy unless --temperature > 0.")
    _generate_flags(g)
    engine_flags(g)
    b = command("bench", "decode (or --prefill) benchmark: tok/s against the floor",
                "Decode benchmark on a model folder or a random model: prints one JSON line per "
                "row. --prefill measures TTFT and prefill tok/s per --input-len instead; "
                "--itl-under-prefill the ITL of --batch-size streams while one --input-len "
                "prompt prefills; --prefix-cache a --workload (multi-turn or agentic) with the "
                "prefix cache on and off.")
    bench_arguments(b)
    q = command("quantize", "write a ModelOpt-format quantized checkpoint",
                "Quantize a dense Nemotron-H folder into ModelOpt's layout.")
    q.add_argument("--model-path", required=True, help="dense input folder (required)")
    q.add_argument("--output", required=True, help="output folder, new or empty (required)")
    q.add_argument("--quant-algo", required=True, type=canonical(QUANT_ALGOS), choices=QUANT_ALGOS,
                   help="format: W4A16_NVFP4 = NVFP4 weights with 16-bit activations (required)")
    q.add_argument("--recipe", choices=["lightning"],
                   help="per-layer formats for MIXED_PRECISION; default: none")
    q.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --output (its contents are deleted)")
    for add in (add_train_target, add_train_draft, add_eval):   # each sets its own handler
        add(sub)
    add_serve_parser(sub)
    return top


# ---- generate ---------------------------------------------------------------------------------
def _parse_ids(text: str, flag: str) -> list[int]:
    """Comma-separated ids as a non-empty list, checked before any model is loaded."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError(f"{flag} is empty ({text!r}); give at least one token id, e.g. 1,2,3")
    return ids


def _prompts(ns: argparse.Namespace) -> list[str]:
    texts = ([ns.prompt_pos] if ns.prompt_pos is not None else []) + (ns.prompt or [])
    for i, t in enumerate(texts):       # argv decodes a non-UTF-8 byte to a lone surrogate
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            ch = ord(t[e.start])
            what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else repr(t[e.start])
            raise ValueError(f"prompt {i + 1} is not UTF-8 text: character {e.start} is "
                             f"{what}") from None
    if ns.prompt_file is not None:
        name = "stdin" if ns.prompt_file == "-" else ns.prompt_file
        try:
            raw = sys.stdin.read() if ns.prompt_file == "-" else Path(ns.prompt_file).read_text()
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompt-file {name}: not UTF-8 text ({e.reason} at byte "
                             f"{e.start})") from None
        from_file = [line for line in raw.splitlines() if line.strip()]
        if not from_file:
            raise ValueError(f"--prompt-file {ns.prompt_file}: no prompts (one per line expected)")
        texts += from_file
    return texts


def _generate(ns: argparse.Namespace) -> int:
    texts = _prompts(ns)
    if bool(texts) == (ns.input_ids is not None):
        raise ValueError("give a text prompt (PROMPT, --prompt or --prompt-file) or --input-ids, "
                         "exactly one kind")
    if ns.chat and not texts:
        raise ValueError("--chat needs a text prompt, not --input-ids")
    sp = {k: getattr(ns, k) for k in SAMPLING_FLAGS if getattr(ns, k) is not None}
    if ns.stop_token_ids is not None:
        sp["stop_token_ids"] = _parse_ids(ns.stop_token_ids, "--stop-token-ids")
    ids = _parse_ids(ns.input_ids, "--input-ids") if ns.input_ids is not None else None
    engine_kwargs = {f.name: getattr(ns, f.name) for f in fields(EngineArgs) if f.name != "extra"}

    # lazy: torch loads only when a command runs
    from blockspec.engine import Engine
    from blockspec.sampling import SamplingParams, SamplingParamsError
    try:        # the ranges the engine checks, before a model is loaded for nothing
        SamplingParams.from_dict(sp)
    except SamplingParamsError as e:
        flag = f"--{e.param.replace('_', '-')}: " if e.param else ""
        raise ValueError(f"{flag}{e}") from None

    if engine_kwargs["model_path"] is None:
        path, engine_kwargs = demo_engine_kwargs(engine_kwargs.pop("model_path"), engine_kwargs)
        algo, draft = engine_kwargs["speculative_algorithm"], engine_kwargs.get(
            "speculative_draft_model_path")
        print(f"blockspec: {describe(path, algo, draft)}", file=sys.stderr, flush=True)
        engine_kwargs["model_path"] = path
    engine = Engine(**engine_kwargs)
    progress = TokenProgress(enabled=ns.verbose or sys.stderr.isatty())
    engine.on_step = progress
    try:
        if ns.chat:
            if engine.tokenizer is None:
                raise ValueError("--chat needs a tokenizer, but the model folder has no tokenizer.json")
            texts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": t}])
                     for t in texts]
        if ids is not None:
            outs = [engine.generate(input_ids=ids, sampling_params=sp, return_logprob=ns.return_logprob)]
        else:
            outs = engine.generate(prompt=texts, sampling_params=sp, return_logprob=ns.return_logprob)
    finally:
        progress.close()
        width = engine.verify_width
        engine.shutdown()
    _print_results(outs, ns, show_ids=engine.tokenizer is None)
    summary = _spec_summary(outs, engine.args.speculative_algorithm, width)
    if summary and not ns.json:                     # JSON carries it in meta_info
        print(f"blockspec: {summary}", file=sys.stderr)
    return 0


def _spec_summary(outs: list[dict], algorithm: str | None, width: int) -> str | None:
    """``DFLASH accept length 4.12 (...)``: tokens committed per verify over all prompts."""
    metas = [o["meta_info"] for o in outs if o["meta_info"].get("spec_verify_ct")]
    if not metas:
        return None
    verifies = sum(m["spec_verify_ct"] for m in metas)
    accept = sum(m["spec_accept_length"] * m["spec_verify_ct"] for m in metas) / verifies
    return (f"{algorithm} accept length {accept:.2f} (tokens committed per verify, bonus "
            f"included; {verifies} verifies, verify width {width})")


def _print_results(outs: list[dict], ns: argparse.Namespace, show_ids: bool) -> None:
    if ns.json:
        print(json.dumps(outs[0] if len(outs) == 1 else outs, indent=1))
    for i, out in enumerate(outs):
        if not ns.json:
            if len(outs) > 1:                        # headers as `head` prints for several files
                print(("\n" if i else "") + f"==> prompt {i + 1}/{len(outs)} <==")
            print(out["output_ids"] if show_ids and not out["text"] else out["text"])
        if ns.verbose:
            print(f"meta_info[{i}]: {json.dumps(out['meta_info'])}", file=sys.stderr)


# ---- other commands ---------------------------------------------------------------------------
def _quantize(ns: argparse.Namespace) -> int:
    # lazy: torch loads only when a command runs
    from blockspec.quant.quantize import quantize_checkpoint

    report = quantize_checkpoint(ns.model_path, ns.output, ns.quant_algo, recipe=ns.recipe,
                                 overwrite=ns.overwrite)
    for notice in getattr(report, "notices", []):
        print(f"notice: {notice}", file=sys.stderr)
    print(f"wrote {ns.quant_algo} checkpoint to {ns.output}")
    return 0


def _bench(ns: argparse.Namespace) -> int:
    # lazy: torch loads only when a command runs
    from blockspec.bench.engine_bench import main as bench_main
    from blockspec.bench.itl_bench import main as itl_main  # lazy: as above
    from blockspec.bench.prefill_bench import main as prefill_main  # lazy: as above
    from blockspec.bench.prefix_bench import main as prefix_main  # lazy: as above

    chosen = [f for f, on in (("--prefill", ns.prefill), ("--itl-under-prefill",
                                                          ns.itl_under_prefill),
                              ("--prefix-cache", ns.prefix_cache)) if on]
    if len(chosen) > 1:
        print(f"blockspec bench: {' and '.join(chosen)} are separate benchmarks: give one",
              file=sys.stderr)
        return 2
    if ns.prefix_cache:
        return prefix_main(ns)
    return (prefill_main if ns.prefill else itl_main if ns.itl_under_prefill else bench_main)(ns)


def _serve(ns: argparse.Namespace) -> int:
    # lazy: torch loads only when a command runs
    from blockspec.server.launch import run

    return run(ns)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": _generate, "bench": _bench, "quantize": _quantize, "serve": _serve}


class _Sigint:
    """SIGINT as Python's default handler (KeyboardInterrupt), remembering that it came: a
    KeyboardInterrupt raised inside a torch or safetensors call can surface as another error
    (``could not determine the shape of object type ...``), which is then still an interrupt."""

    def __init__(self) -> None:
        self.hit = False
        self.previous: Any = None

    def __call__(self, sig: int, frame: Any) -> None:
        self.hit = True
        raise KeyboardInterrupt

    def __enter__(self) -> "_Sigint":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self.previous = signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def main(argv: list[str] | None = None) -> int:
    name = "blockspec"
    with _Sigint() as sigint:
        try:
            ns = build_parser().parse_args(argv)
            name = f"blockspec {ns.command}"
            handler = getattr(ns, "handler", None) or COMMANDS[ns.command]
            return handler(ns)
        except KeyboardInterrupt:
            print(f"{name}: interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            if sigint.hit:                               # an interrupt torch turned into an error
                print(f"{name}: interrupted", file=sys.stderr)
                return 130
            if not isinstance(e, (ValueError, RuntimeError, OSError, KeyError)):
                raise
            print(f"{name}: error: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
