"""``blockspec bench`` flags, apart from the benchmark so that building the CLI parser (and so
``--help`` and argument errors) never imports torch. The CLI's help formatter appends each
flag's default and choices."""
from __future__ import annotations

import argparse

from blockspec.args import DRAFT_LM_HEADS
from blockspec.bench.accept_profile import NAMED_PROFILES

# Keys of bench.presets.PRESETS (a test keeps the two in step).
PRESET_NAMES = ("lightning-mini", "nemotron-3.5-lightning", "tiny")
# "dflash", "dspark" and the keys of bench.draft_presets.DRAFT_PRESETS (a test keeps them in step)
RANDOM_DRAFTS = ("dflash", "dspark", "dflash-nemotron35", "dspark-nemotron35")


# --input-len / --output-len when not given (the prefix cache bench has its own)
INPUT_LEN, OUTPUT_LEN = 128, 64


def with_lengths(args: argparse.Namespace, input_len: int = INPUT_LEN,
                 output_len: int = OUTPUT_LEN) -> argparse.Namespace:
    """``args`` with a bench's defaults where ``--input-len`` / ``--output-len`` were not
    given (the parser leaves them None, so each bench can pick its own)."""
    return argparse.Namespace(**{
        **vars(args),
        "input_len": [input_len] if args.input_len is None else args.input_len,
        "output_len": output_len if args.output_len is None else args.output_len})


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", help="model folder to benchmark; default: a random model "
                                        "built in memory from --preset (nothing is written)")
    p.add_argument("--preset", default="tiny", choices=PRESET_NAMES,
                   help="shapes of the random model used without --model-path (tiny = the demo "
                        "model; lightning-mini = Lightning's layer shapes, 6 layers; "
                        "nemotron-3.5-lightning = the full 52-layer model)")
    p.add_argument("--quantized", action="store_true",
                   help="build the preset in Lightning's quantization (W4A16_NVFP4 experts, shared "
                        "experts and lm_head; FP8 Mamba projections) instead of bf16")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N; default: auto")
    p.add_argument("--dtype", help="auto, float32, bfloat16 or float16; default: auto (bf16 for "
                                   "presets)")
    p.add_argument("--random-draft", choices=RANDOM_DRAFTS,
                   help="attach a random draft of this kind, built in memory (measures step cost; "
                        "see --simulate-accept-length for speed-up): dflash / dspark = a generic "
                        "2-layer bf16 draft; *-nemotron35 = shaped like Nemotron 3.5 Lightning's "
                        "published drafts (0.74 B / 0.81 B parameters, W4A16 NVFP4)")
    p.add_argument("--speculative-algorithm", help="DFLASH or DSPARK with "
                                                   "--speculative-draft-model-path; default: off")
    p.add_argument("--speculative-draft-model-path", help="draft checkpoint folder; default: none")
    p.add_argument("--speculative-num-draft-tokens", type=int,
                   help="verify block width; default: the draft's block_size (4 for --random-draft)")
    p.add_argument("--speculative-draft-lm-head", default="auto", choices=DRAFT_LM_HEADS,
                   help="head that scores draft blocks: the target's as stored, a W4A16 NVFP4 "
                        "copy made at load (verification stays exact), or auto (the copy for a "
                        "dense 16-bit head on CUDA)")
    p.add_argument("--speculative-adaptive", action="store_true",
                   help="choose each step's verify width (1 .. --speculative-num-draft-tokens) "
                        "from the measured step-time table and live acceptance; rows then report "
                        "the width distribution")
    p.add_argument("--fixed-widths", type=_int_list, metavar="W[,W...]",
                   help="with --speculative-adaptive: before each batch size's adaptive row, one "
                        "row per width with the choice pinned to it, on the same engine (its "
                        "graphs, cost table and prompts): the fixed widths adaptive is compared "
                        "with; default: none")
    p.add_argument("--simulate-accept-length", type=float, metavar="TAU",
                   help="force the mean tokens committed per verify (bonus included) to TAU, as if "
                        "a trained draft were attached (sglang's simulated acceptance): the profile "
                        "that accepts floor(TAU-1) or ceil(TAU-1) drafts; default: off")
    p.add_argument("--simulate-accept-profile", metavar="P1,P2,...|NAME",
                   help="force acceptance per draft position: P(draft i accepted | drafts before "
                        "it accepted), a comma list covering the verify block, or one of "
                        + ", ".join(NAMED_PROFILES) + " (docs/benchmarks.md); default: off")
    p.add_argument("--steady-state", type=int, metavar="R",
                   help="a server's batch: R x batch-size requests queued at once, at most "
                        "batch-size running, each replaced from the queue as it finishes, output "
                        "lengths uniform in [L/2, 3L/2]; the rate is over the whole run, the "
                        "replacements' prefills included; default: one batch that starts and "
                        "ends together")
    p.add_argument("--simulate-text", action="store_true",
                   help="every step commits a fixed random text (token k of a request a function "
                        "of its seed and k) instead of the model's choice, as the simulated "
                        "acceptance flags do (they imply it): the plain-decoding rows a simulated "
                        "speculative run is compared with; default: off")
    p.add_argument("--simulate-low-accept-phases", metavar="every=N,len=L,scale=S",
                   help="with a simulated acceptance: the last L of every N verify steps of a "
                        "request multiply each probability by S; default: off")
    p.add_argument("--json-schema", metavar="FILE",
                   help="constrain every sequence to this JSON schema (structured output), to "
                        "measure the grammar mask's cost; a preset gets a synthetic byte-level "
                        "vocabulary of its size; default: unconstrained")
    p.add_argument("--batch-size", type=_int_list, default=[1], metavar="N[,N...]",
                   help="sequences decoded together; a list runs each size on the same model")
    p.add_argument("--input-len", type=_int_list, metavar="N[,N...]",
                   help=f"prompt tokens per sequence (default {INPUT_LEN}; with --prefix-cache "
                        "the history / shared prefix: 32768 multi-turn, 65536 agentic); a list "
                        "only with --prefill (one row each)")
    p.add_argument("--output-len", type=int,
                   help=f"tokens generated per sequence (default {OUTPUT_LEN}; with "
                        "--prefix-cache: 256 multi-turn, 400 agentic)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run every step eagerly (the reference figure)")
    p.add_argument("--compare-eager", action="store_true",
                   help="also time the same build with CUDA graphs off, in the same run")
    p.add_argument("--compare-transformers", action="store_true",
                   help="also time transformers' NemotronHForCausalLM on the same shapes and prompts "
                        "(bf16 only) and report the ratio")
    p.add_argument("--chunked-prefill-size", type=_int_list, metavar="N[,N...]",
                   help="most prompt tokens per prefill forward; a list only with --prefill "
                        "(each length runs at each size, on the same engine); default: the "
                        "engine's (2048)")
    p.add_argument("--prefill", action="store_true",
                   help="measure prefill instead of decode: TTFT, prefill tok/s and the compute "
                        "floor (config FLOPs over a bf16 matmul rate measured in the same run) "
                        "for each --input-len, at batch 1")
    p.add_argument("--itl-under-prefill", action="store_true",
                   help="measure the inter-token latency of --batch-size running streams while "
                        "one --input-len prompt prefills (steady and during, p50/p99); "
                        "--output-len must outlast the prefill")
    p.add_argument("--decoding-prefill-chunk-size", type=_int_list, metavar="N[,N...]",
                   help="with --itl-under-prefill: the most prompt tokens per prefill forward "
                        "while the streams decode; a list runs each on the same engine; "
                        "default: the engine's (512)")
    p.add_argument("--breakdown", action="store_true",
                   help="with --prefill: also split one prefill of each length by layer kind "
                        "(Mamba, attention, MoE, norms, lm_head, engine), as a table and JSON")
    p.add_argument("--prefix-cache", action="store_true",
                   help="measure the prefix cache: the same --workload with the cache on and off, "
                        "on one preset (TTFT, request times, cached tokens and their ratios)")
    p.add_argument("--workload", default="multi-turn", choices=("multi-turn", "agentic"),
                   help="with --prefix-cache: --batch-size conversations of --turns turns whose "
                        "history grows to --input-len (default 32768), or --num-requests "
                        "requests on one --input-len shared prefix (default 65536) with distinct "
                        "--suffix-len suffixes at each --concurrency")
    p.add_argument("--turns", type=int, default=8, help="with --workload multi-turn: turns per "
                                                         "conversation")
    p.add_argument("--suffix-len", type=int, default=1024,
                   help="with --workload agentic: distinct tokens after the shared prefix")
    p.add_argument("--num-requests", type=int, default=32,
                   help="with --workload agentic: requests (the first runs alone and fills the "
                        "cache)")
    p.add_argument("--concurrency", type=_int_list, default=[16], metavar="N[,N...]",
                   help="with --workload agentic: requests kept in flight (closed loop); a list "
                        "runs each")
    p.add_argument("--page-size", type=int, help="with --prefix-cache: KV page tokens; default: "
                                                 "the engine's (16)")
    p.add_argument("--mamba-track-interval", type=int,
                   help="with --prefix-cache: tokens between Mamba checkpoints; default: the "
                        "engine's (256)")
    p.add_argument("--mamba-cache-slots", type=int,
                   help="with --prefix-cache: Mamba snapshots kept; default: the engine's")
    p.add_argument("--out", help="append the JSON lines to this file; default: print only")
