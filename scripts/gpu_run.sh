#!/usr/bin/env bash
# GPU runs recorded in docs/benchmarks.md. Usage: scripts/gpu_run.sh tests|engine  (logs to $OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
case "${1:-tests}" in
tests)
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  python3 -m pytest -m gpu tests/test_triton_w4a16.py tests/test_moe_grouped.py tests/test_gpu_engine.py \
      -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/gpu_tests.log"
  timeout 420 python3 -m blockspec.bench.w4a16 --out "$OUT/w4a16.json" 2>&1 | tee "$OUT/w4a16.log"
  ;;
engine)
  M=/tmp/lm; B="python3 -m blockspec.cli bench --device cuda --dtype bfloat16 --input-len 128 --output-len 64 --out $OUT/engine.jsonl"
  python3 -c "from blockspec.bench.engine_bench import write_random_model as w; from pathlib import Path; w('lightning-mini', Path('$M'))"
  $B --model-path $M/lightning-mini
  $B --model-path $M/lightning-mini --batch-size 8
  $B --model-path $M/lightning-mini --random-draft dflash --speculative-num-draft-tokens 4
  $B --model-path $M/lightning-mini --random-draft dspark --speculative-num-draft-tokens 4
  python3 -m blockspec.cli quantize --model-path $M/lightning-mini --output $M/lightning-mini-mixed \
      --quant-algo MIXED_PRECISION --recipe lightning
  $B --model-path $M/lightning-mini-mixed
  $B --model-path $M/lightning-mini-mixed --batch-size 8
  $B --model-path $M/lightning-mini-mixed --random-draft dflash --speculative-num-draft-tokens 4
  cat "$OUT/engine.jsonl"
  ;;
final)
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  timeout 300 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider -o addopts="" -x 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
  M=/tmp/lm; B="python3 -m blockspec.cli bench --device cuda --dtype bfloat16 --input-len 128 --output-len 64 --out $OUT/engine.jsonl"
  python3 -c "from blockspec.bench.engine_bench import write_random_model as w; from pathlib import Path; w('lightning-mini', Path('$M'))"
  python3 -m blockspec.cli quantize --model-path $M/lightning-mini --output $M/lightning-mini-mixed \
      --quant-algo MIXED_PRECISION --recipe lightning
  $B --model-path $M/lightning-mini-mixed 2>>"$OUT/stderr.log"
  $B --model-path $M/lightning-mini-mixed --batch-size 8 2>>"$OUT/stderr.log"
  $B --model-path $M/lightning-mini-mixed --random-draft dflash --speculative-num-draft-tokens 4 2>>"$OUT/stderr.log"
  $B --model-path $M/lightning-mini-mixed --random-draft dspark --speculative-num-draft-tokens 4 2>>"$OUT/stderr.log"
  $B --model-path $M/lightning-mini --random-draft dflash --speculative-num-draft-tokens 4 2>>"$OUT/stderr.log"
  python3 scripts/profile_step.py --model-path $M/lightning-mini-mixed --out "$OUT/profile_ar.txt" 2>>"$OUT/stderr.log"
  python3 scripts/profile_step.py --model-path $M/lightning-mini-mixed --draft $M/lightning-mini-mixed-dflash-b4 \
      --out "$OUT/profile_dflash.txt" 2>>"$OUT/stderr.log"
  tail -8 "$OUT/profile_ar.txt" "$OUT/profile_dflash.txt"
  ;;
esac
