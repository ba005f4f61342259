"""``blockspec bench`` flags, apart from the benchmark so that building the CLI parser (and so
``--help`` and argument errors) never imports torch. The CLI's help formatter appends each
flag's default and choices."""
from __future__ import annotations

import argparse

# Keys of engine_bench.RANDOM_CONFIGS (a test keeps the two in step).
RANDOM_CONFIG_NAMES = ("lightning-mini", "tiny")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", help="model folder to benchmark; default: a random model "
                                        "written from --random-config")
    p.add_argument("--random-config", default="tiny", choices=RANDOM_CONFIG_NAMES,
                   help="shapes of the random model used without --model-path (tiny = the demo "
                        "model; lightning-mini = Lightning's layer shapes, 6 layers)")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N; default: auto")
    p.add_argument("--dtype", help="auto, float32, bfloat16 or float16; default: auto")
    p.add_argument("--random-draft", choices=["dflash", "dspark"],
                   help="attach a random draft of this kind (measures step cost, not speed-up)")
    p.add_argument("--speculative-algorithm", help="DFLASH or DSPARK with "
                                                   "--speculative-draft-model-path; default: off")
    p.add_argument("--speculative-draft-model-path", help="draft checkpoint folder; default: none")
    p.add_argument("--speculative-num-draft-tokens", type=int,
                   help="verify block width; default: the draft's block_size (4 for --random-draft)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences decoded together")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--out", help="append the JSON result to this file; default: print only")
