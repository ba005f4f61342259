#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
T0=$(date +%s)
timeout 170 python3 -m pytest -m gpu tests/test_gpu_runtime.py tests/test_gpu_engine.py \
   tests/test_draft_kv.py tests/test_fp8_quant.py tests/test_w4a16_tuned.py -q -p no:cacheprovider \
   -o addopts="" -rf -x 2>&1 | tail -40 > "$OUT/gpu_tests.log"; tail -5 "$OUT/gpu_tests.log"
echo "tests done $(( $(date +%s) - T0 )) s"
timeout 230 python3 scripts/bench_w4a16_decode.py --out "$OUT/w4_sweep.json" --write-table "$OUT/w4a16_tuned.json" --jobs 16 > "$OUT/w4_sweep.txt" 2>&1
tail -30 "$OUT/w4_sweep.txt"
echo "sweep done $(( $(date +%s) - T0 )) s"
P="timeout 40 python3 scripts/profile_step.py --preset lightning-mini"
$P --out "$OUT/p_ar.txt" 2>>"$OUT/stderr.log"
$P --draft dspark --width 4 --out "$OUT/p_ds.txt" 2>>"$OUT/stderr.log"
$P --draft dspark --width 4 --draft-lm-head nvfp4 --out "$OUT/p_ds4.txt" 2>>"$OUT/stderr.log"
$P --draft dflash --width 4 --draft-lm-head nvfp4 --out "$OUT/p_df4.txt" 2>>"$OUT/stderr.log"
grep -h "preset\|graph replay\|eager step" "$OUT"/p_*.txt
echo "all done $(( $(date +%s) - T0 )) s"
