#!/usr/bin/env bash
# GPU runs recorded in docs/benchmarks.md. Usage: scripts/gpu_run.sh STAGE... (logs to $OUT)
#   tests      the GPU-marked tests (pytest -m gpu; GPU_TESTS=files to run a share)
#   profile    lightning-mini step profiles (AR, DFlash, DSpark, verify alone, quantized AR)
#   mini       lightning-mini benches: AR / DFlash / DSpark, bf16 and quantized, graphs vs eager
#   ratio      lightning-mini batch 1, 512 tokens x 5 repeats: AR, DSpark, DFlash (#10's step ratios)
#   simulate   lightning-mini with the published acceptance simulated
#   full       full Nemotron 3.5 Lightning preset: bf16 and quantized, batch 1,4,16,64, transformers
#   fullspec   full preset, own AR vs DFlash w6 tau 4.2 vs DSpark gamma 3 tau 3.7, batch 1,4,16,64
#   fullspecq  fullspec in the Lightning quantization (W4A16 experts / shared / lm_head, FP8 Mamba)
#   fullprof   full preset step profiles by phase and layer kind (AR bf16 / quantized, DFlash)
#   mamba      the Mamba step kernels' GPU tests (tests/test_kernels.py) and the quantized
#              full preset's AR and DFlash width-7 step profiles (the _mamba_steps_kernel rows)
#   longctx    full preset, batch 1 decode after a 1k and a 16k prompt
#   prefill    full preset TTFT vs the compute floor, 1k-128k prompts, quantized and bf16;
#              the quantized 16k prefill's breakdown by layer kind (table: prefill_breakdown.txt)
#   attn       the paged attention kernel's prefill launch-config sweep (attn_prefill.jsonl)
#   decodeq    quantized full preset, published-size drafts at the published acceptance:
#              AR, DFlash w6, adaptive (max 8) and DSpark, batch 1,4,16,64,128
#   widths     AR, and adaptive (max 8) against each fixed DFlash width pinned on the same
#              engine, batch 1,4,16,64,128, published profile and tau 1.5; prints
#              scripts/adaptive_table.py (about 7 minutes: a call of its own)
#   tau15      the tau-1.5 rows alone (batch 1 and 4, 256 tokens x 3): AR, widths 1-2, adaptive
#   itl        streams' inter-token latency while a 32k prompt prefills (chunks 64, 128)
#   prefixc    prefix cache: multi-turn batch 1 and 16 to 32k; agentic with DFlash
#   w4a16cuda  the W4A16 CUDA kernel (MoE pairs, dense up to 16 rows): its GPU tests and
#              bench_w4a16_cuda.py against the Triton kernels, whose tile table
#              (w4a16_cuda_tiles.json) the later stages of the call use (about 6 minutes)
#   nexttests  the GPU tests that have not run on the current tree: the W4A16 linears (their
#              small calls now take the CUDA kernel), the engine's (AR / DFlash / DSpark
#              against the CPU reference and target-only decoding, every adaptive width) and
#              the kernels' (the Mamba step's launch layouts among them)
#   b16        batch 16: AR and DFlash widths 4-6 pinned and adaptive (256 tokens x 3)
#   b16prof    graph replays of widths 4 and 5 at batch 16 on the batch's rows, on the cost
#              table's dummy rows and on one shared slot (profile_step)
#   ncucuda    ncu on the CUDA W4A16 kernel's MoE pair calls at 7, 4 and 1 tokens (where the
#              verify's calls lose their time; bytes in flight are ruled out, benchmarks.md)
#   moepath    the MoE stack through the pair path and through the grouped path, 1-16 tokens
#              (scripts/bench_moe_paths.py: where PAIR_PATH_MAX_PAIRS should cut)
#   steady     a server's batch (--steady-state 4: replaced as requests finish) at batch 16 and
#              64: AR, and adaptive (max 8) against widths 3-6 pinned, published profile
#   batch1     batch 1 of the quantized full preset: AR, DFlash widths 6-8 pinned and adaptive,
#              DSpark gamma 3 pinned and adaptive up to width 8 (published profiles), and the
#              DFlash width-7 and DSpark gamma-3 steps' profiles
#   abreplay   an A/B of the batch-1 steps' graph replays (profile_step: AR, DFlash width 7,
#              DSpark gamma 3) between this tree and the trees in the folders $BASE (a space
#              list; rows tagged by folder name), interleaved on one machine. Make each with
#              `git archive REF | tar -x -C _ab_x` (untracked, so it travels with the working
#              tree; docs/ and the demo weights may go, not blockspec/demo_family's modules,
#              which the engine imports); one line a run in $OUT/replays.txt
# REQUIRE_GPU=H200 stops at once (exit 3) on any other card: a call that may land on either
# kind then costs only its start when the wrong one comes.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "gpu: ${gpu:-none}"
if [ -n "${REQUIRE_GPU:-}" ] && [[ "$gpu" != *"$REQUIRE_GPU"* ]]; then
  echo "not a $REQUIRE_GPU: stop"; exit 3
fi
B="python3 -m blockspec.cli bench --device cuda --out $OUT/bench.jsonl"
# AR, then DFlash (published profile, adaptive up to width 8) with the widths $2 pinned on the
# same engine, at batch size $1, 256 tokens x 3 (the DFlash run limited to $3 s); prints the table
widths_rows() {
  local L="python3 -m blockspec.cli bench --device cuda --preset nemotron-3.5-lightning \
     --quantized --output-len 256 --repeats 3 --batch-size $1"
  timeout 100 $L --simulate-text --out "$OUT/ar_b$1.jsonl" 2>>"$OUT/stderr.log" >/dev/null
  timeout "$3" $L --random-draft dflash-nemotron35 --speculative-num-draft-tokens 8 \
      --speculative-adaptive --fixed-widths "$2" --simulate-accept-profile dflash-published \
      --out "$OUT/dflash_b$1.jsonl" 2>>"$OUT/stderr.log" >/dev/null
  python3 scripts/adaptive_table.py "$OUT/ar_b$1.jsonl" "$OUT/dflash_b$1.jsonl"
}
# the graph replay and kernels of one DFlash step at batch size $1 and width $2
profile_width() {
  timeout 90 python3 scripts/profile_step.py --preset nemotron-3.5-lightning --quantized \
      --batch-size "$1" --draft dflash-nemotron35 --width 8 --step-width "$2" \
      --simulate-accept-length 4.41 --out "$OUT/profile_w$2_b$1.txt" 2>>"$OUT/stderr.log"
}
for stage in "$@"; do
case "$stage" in
tests)
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  # the GPU machine has no pydantic/fastapi: the server's test modules fail to collect there
  # and are passed over. All ~380 GPU tests take longer than one call (144 ran in 7 minutes on
  # 2026-12-03): GPU_TESTS="tests/test_a.py tests/test_b.py ..." runs a share per call
  timeout 560 python3 -m pytest -m gpu ${GPU_TESTS:-tests} -q -p no:cacheprovider \
      --continue-on-collection-errors \
      -o addopts="" -rf 2>&1 | tail -60 > "$OUT/gpu_tests.log"; tail -15 "$OUT/gpu_tests.log"
  ;;
profile)
  P="timeout 50 python3 scripts/profile_step.py --preset lightning-mini"
  $P --out "$OUT/profile_ar.txt" 2>>"$OUT/stderr.log"
  $P --draft dflash --width 4 --out "$OUT/profile_dflash.txt" 2>>"$OUT/stderr.log"
  $P --draft dspark --width 4 --out "$OUT/profile_dspark.txt" 2>>"$OUT/stderr.log"
  $P --verify-only --width 4 --out "$OUT/profile_verify.txt" 2>>"$OUT/stderr.log"
  $P --quantized --out "$OUT/profile_ar_quant.txt" 2>>"$OUT/stderr.log"
  grep -h "preset\|graph replay\|eager step" "$OUT"/profile_*.txt
  ;;
mini)
  timeout 60 $B --preset lightning-mini --batch-size 1,8 --compare-eager 2>>"$OUT/stderr.log"
  timeout 60 $B --preset lightning-mini --quantized --batch-size 1 --compare-eager 2>>"$OUT/stderr.log"
  timeout 60 $B --preset lightning-mini --random-draft dflash --speculative-num-draft-tokens 4 \
      --batch-size 1 --compare-eager 2>>"$OUT/stderr.log"
  timeout 60 $B --preset lightning-mini --random-draft dspark --speculative-num-draft-tokens 4 \
      --batch-size 1 --compare-eager 2>>"$OUT/stderr.log"
  ;;
ratio)
  R="timeout 40 $B --preset lightning-mini --batch-size 1 --output-len 512 --repeats 5"
  $R 2>>"$OUT/stderr.log"
  $R --random-draft dspark --speculative-num-draft-tokens 4 2>>"$OUT/stderr.log"
  $R --random-draft dflash --speculative-num-draft-tokens 4 2>>"$OUT/stderr.log"
  ;;
simulate)
  # published Lightning acceptance, simulated: DFlash width 6 at tau 4.2, DSpark gamma 3 at 3.7
  timeout 60 $B --preset lightning-mini --random-draft dflash --speculative-num-draft-tokens 6 \
      --simulate-accept-length 4.2 --batch-size 1,8 2>>"$OUT/stderr.log"
  timeout 60 $B --preset lightning-mini --random-draft dspark --speculative-num-draft-tokens 4 \
      --simulate-accept-length 3.7 --batch-size 1,8 2>>"$OUT/stderr.log"
  ;;
full)
  timeout 250 $B --preset nemotron-3.5-lightning --batch-size 1,4,16,64 --output-len 32 \
      --repeats 2 --compare-transformers 2>>"$OUT/stderr.log"
  timeout 150 $B --preset nemotron-3.5-lightning --quantized --batch-size 1,4,16,64 \
      --output-len 32 --repeats 2 2>>"$OUT/stderr.log"
  timeout 45 $B --preset lightning-mini --random-draft dspark --speculative-num-draft-tokens 4 \
      --batch-size 1 2>>"$OUT/stderr.log"
  timeout 45 $B --preset lightning-mini --batch-size 1 2>>"$OUT/stderr.log"
  ;;
fullspec|fullspecq)
  Q=""; [ "$stage" = fullspecq ] && Q="--quantized"
  F="$B --preset nemotron-3.5-lightning $Q --batch-size 1,4,16,64 --output-len 128 --repeats 2"
  timeout 150 $F --simulate-text 2>>"$OUT/stderr.log"
  timeout 180 $F --random-draft dflash --speculative-num-draft-tokens 6 \
      --simulate-accept-length 4.2 2>>"$OUT/stderr.log"
  timeout 180 $F --random-draft dspark --speculative-num-draft-tokens 4 \
      --simulate-accept-length 3.7 2>>"$OUT/stderr.log"
  ;;
fullprof)
  P="timeout 90 python3 scripts/profile_step.py --preset nemotron-3.5-lightning"
  $P --out "$OUT/profile_full_ar.txt" 2>>"$OUT/stderr.log"
  $P --quantized --out "$OUT/profile_full_ar_quant.txt" 2>>"$OUT/stderr.log"
  $P --quantized --batch-size 64 --out "$OUT/profile_full_ar_quant_b64.txt" 2>>"$OUT/stderr.log"
  $P --draft dflash --width 6 --out "$OUT/profile_full_dflash.txt" 2>>"$OUT/stderr.log"
  grep -h "preset\|graph replay\|eager step" "$OUT"/profile_full_*.txt
  ;;
mamba)
  timeout 150 python3 -m pytest -m gpu tests/test_kernels.py -q -p no:cacheprovider \
      -o addopts="" -rf 2>&1 | tail -20 > "$OUT/gpu_tests_mamba.log"; tail -3 "$OUT/gpu_tests_mamba.log"
  P="timeout 90 python3 scripts/profile_step.py --preset nemotron-3.5-lightning --quantized"
  $P --out "$OUT/profile_ar_b1.txt" 2>>"$OUT/stderr.log"
  $P --draft dflash-nemotron35 --width 8 --step-width 7 --simulate-accept-length 4.41 \
      --out "$OUT/profile_w7_b1.txt" 2>>"$OUT/stderr.log"
  grep -h "graph replay\|_mamba_steps_kernel" "$OUT"/profile_ar_b1.txt "$OUT"/profile_w7_b1.txt
  ;;
longctx)
  L="$B --preset nemotron-3.5-lightning --batch-size 1 --output-len 128 --repeats 2"
  timeout 120 $L --input-len 1024 2>>"$OUT/stderr.log"
  timeout 150 $L --input-len 16384 2>>"$OUT/stderr.log"
  ;;
prefill)
  F="$B --preset nemotron-3.5-lightning --prefill --repeats 2"
  timeout 280 $F --quantized --input-len 1024,4096,16384,65536,131072 2>>"$OUT/stderr.log"
  timeout 280 $F --input-len 1024,4096,16384,65536,131072 2>>"$OUT/stderr.log"
  timeout 150 $F --quantized --input-len 16384 --repeats 1 --breakdown 2>>"$OUT/prefill_breakdown.txt"
  ;;
attn)
  timeout 330 python3 scripts/tune_attention_prefill.py --out "$OUT/attn_prefill.jsonl" \
      --budget-s 270 2>>"$OUT/stderr.log" | tail -12
  ;;
decodeq)
  Q="$B --preset nemotron-3.5-lightning --quantized --output-len 128 --batch-size 1,4,16,64,128"
  timeout 150 $Q --repeats 1 --simulate-text 2>>"$OUT/stderr.log" >/dev/null
  timeout 200 $Q --repeats 1 --random-draft dflash-nemotron35 --speculative-num-draft-tokens 6 \
      --simulate-accept-profile dflash-published 2>>"$OUT/stderr.log" >/dev/null
  timeout 240 $Q --repeats 1 --random-draft dflash-nemotron35 --speculative-num-draft-tokens 8 \
      --speculative-adaptive --simulate-accept-profile dflash-published 2>>"$OUT/stderr.log" >/dev/null
  timeout 90 $B --preset nemotron-3.5-lightning --quantized --output-len 128 --batch-size 1 \
      --repeats 1 --random-draft dspark-nemotron35 --speculative-num-draft-tokens 4 \
      --simulate-accept-profile dspark-published 2>>"$OUT/stderr.log" >/dev/null
  ;;
widths)
  # AR, then one adaptive engine per acceptance: each fixed width pinned (--fixed-widths), then
  # adaptive, per batch (about 7 minutes; rows reach the files as they are measured)
  L="python3 -m blockspec.cli bench --device cuda --preset nemotron-3.5-lightning --quantized \
     --output-len 128 --repeats 1 --batch-size 1,4,16,64,128"
  timeout 100 $L --simulate-text --out "$OUT/ar.jsonl" 2>>"$OUT/stderr.log" >/dev/null
  W="$L --random-draft dflash-nemotron35 --speculative-num-draft-tokens 8 --speculative-adaptive"
  timeout 300 $W --fixed-widths 2,3,4,5,6,7,8 --simulate-accept-profile dflash-published \
      --out "$OUT/dflash.jsonl" 2>>"$OUT/stderr.log" >/dev/null
  timeout 150 $W --fixed-widths 1,2 --simulate-accept-length 1.5 --out "$OUT/tau15.jsonl" \
      2>>"$OUT/stderr.log" >/dev/null
  python3 scripts/adaptive_table.py "$OUT/ar.jsonl" "$OUT"/dflash.jsonl "$OUT"/tau15.jsonl
  ;;
tau15)
  # the low-acceptance rows alone: AR, widths 1 and 2 pinned and adaptive at tau 1.5, batch 1
  # and 4, 256 tokens x 3 (about 4 minutes)
  L="python3 -m blockspec.cli bench --device cuda --preset nemotron-3.5-lightning --quantized \
     --output-len 256 --repeats 3 --batch-size 1,4"
  timeout 120 $L --simulate-text --out "$OUT/ar_tau15.jsonl" 2>>"$OUT/stderr.log" >/dev/null
  timeout 240 $L --random-draft dflash-nemotron35 --speculative-num-draft-tokens 8 \
      --speculative-adaptive --fixed-widths 1,2 --simulate-accept-length 1.5 \
      --out "$OUT/tau15.jsonl" 2>>"$OUT/stderr.log" >/dev/null
  python3 scripts/adaptive_table.py "$OUT/ar_tau15.jsonl" "$OUT/tau15.jsonl"
  ;;
itl)
  timeout 200 $B --preset nemotron-3.5-lightning --quantized --itl-under-prefill --batch-size 16 \
      --input-len 32768 --output-len 3000 --decoding-prefill-chunk-size 64,128 \
      2>>"$OUT/stderr.log" >/dev/null
  ;;
prefixc)
  P="$B --preset nemotron-3.5-lightning --quantized --prefix-cache"
  timeout 280 $P --workload multi-turn --batch-size 1,16 --input-len 32768 --turns 8 \
      --output-len 256 2>>"$OUT/stderr.log" >/dev/null
  timeout 200 $P --workload agentic --input-len 65536 --suffix-len 1024 --output-len 400 \
      --num-requests 16 --concurrency 1 --random-draft dflash-nemotron35 \
      --speculative-num-draft-tokens 6 --simulate-accept-profile dflash-published \
      2>>"$OUT/stderr.log" >/dev/null
  ;;
w4a16cuda)
  timeout 120 python3 -m pytest -m gpu tests/test_pair_w4a16.py \
      -q -p no:cacheprovider -o addopts="" -rf 2>&1 | tail -30 > "$OUT/gpu_tests_w4a16cuda.log"
  tail -3 "$OUT/gpu_tests_w4a16cuda.log"
  timeout 240 python3 scripts/bench_w4a16_cuda.py --write-table "$OUT/w4a16_cuda_tiles.json" \
      > "$OUT/bench_w4a16cuda.jsonl" 2> "$OUT/bench_w4a16cuda_summary.txt"
  cat "$OUT/bench_w4a16cuda_summary.txt"
  # later stages of this call dispatch by the fresh table (commit it from $OUT to keep it)
  cp "$OUT/w4a16_cuda_tiles.json" blockspec/kernels/ 2>/dev/null
  ;;
nexttests)
  timeout 540 python3 -m pytest -m gpu tests/test_triton_w4a16.py tests/test_draft_kv.py \
      tests/test_gpu_engine.py tests/test_gpu_adaptive.py tests/test_kernels.py -q -p no:cacheprovider \
      -o addopts="" -rf 2>&1 | tail -40 > "$OUT/gpu_tests_next.log"; tail -8 "$OUT/gpu_tests_next.log"
  ;;
b16)
  widths_rows 16 4,5,6 240
  ;;
b16prof)
  for w in 4 5; do profile_width 16 $w; done
  grep -h "graph replay" "$OUT"/profile_w*_b16.txt
  ;;
ncucuda)
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)
  for T in 7 4 1; do
    timeout 150 "$NCU" --clock-control none --kernel-name w4a16_cuda --launch-skip 2 \
        --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
        --section SourceCounters python3 scripts/ncu_pair_w4a16.py --tokens $T \
        > "$OUT/ncu_cuda_pairs$T.txt" 2>&1
  done
  grep -hE "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Waves Per SM|Issued Ipc" \
      "$OUT"/ncu_cuda_pairs*.txt
  ;;
moepath)
  timeout 240 python3 scripts/bench_moe_paths.py --out "$OUT/moe_paths.txt" 2>>"$OUT/stderr.log"
  ;;
steady)
  L="python3 -m blockspec.cli bench --device cuda --preset nemotron-3.5-lightning --quantized \
     --output-len 128 --repeats 1 --steady-state 4 --batch-size 16,64"
  timeout 120 $L --simulate-text --out "$OUT/ar_steady.jsonl" 2>>"$OUT/stderr.log" >/dev/null
  timeout 300 $L --random-draft dflash-nemotron35 --speculative-num-draft-tokens 8 \
      --speculative-adaptive --fixed-widths 3,4,5,6 --simulate-accept-profile dflash-published \
      --out "$OUT/steady.jsonl" 2>>"$OUT/stderr.log" >/dev/null
  python3 scripts/adaptive_table.py "$OUT/ar_steady.jsonl" "$OUT/steady.jsonl"
  ;;
abreplay)
  out=$(realpath "$OUT")
  for spec in "ar:" \
      "dflash7:--draft dflash-nemotron35 --width 8 --step-width 7 --simulate-accept-length 4.41" \
      "dspark4:--draft dspark-nemotron35 --width 4 --simulate-accept-length 3.7"; do
    for tree in . ${BASE:-}; do
      tag=${spec%%:*}_$([ "$tree" = . ] && echo this || basename "$tree")
      (cd "$tree" && PYTHONPATH=$PWD timeout 130 python3 scripts/profile_step.py \
          --preset nemotron-3.5-lightning --quantized ${spec#*:} --out "$out/prof_$tag.txt" \
          2>>"$out/stderr.log" >/dev/null)
      echo "$tag $(grep -h 'graph replay: ' "$out/prof_$tag.txt" 2>/dev/null | head -1)" \
          | tee -a "$out/replays.txt"
    done
  done
  ;;
batch1)
  widths_rows 1 6,7,8 150
  # DSpark: gamma 3 (width 4) pinned, then adaptive up to width 8 on the same engine
  timeout 150 python3 -m blockspec.cli bench --device cuda --preset nemotron-3.5-lightning \
      --quantized --output-len 256 --repeats 3 --batch-size 1 --random-draft dspark-nemotron35 \
      --speculative-num-draft-tokens 8 --speculative-adaptive --fixed-widths 4 \
      --simulate-accept-profile dspark-published --out "$OUT/dspark_b1.jsonl" \
      2>>"$OUT/stderr.log" >/dev/null
  python3 scripts/adaptive_table.py "$OUT/ar_b1.jsonl" "$OUT/dspark_b1.jsonl"
  profile_width 1 7
  # the DSpark gamma-3 step (width 4) at the published 3.7
  timeout 90 python3 scripts/profile_step.py --preset nemotron-3.5-lightning --quantized \
      --draft dspark-nemotron35 --width 4 --simulate-accept-length 3.7 \
      --out "$OUT/profile_dspark_w4_b1.txt" 2>>"$OUT/stderr.log"
  ;;
esac
done
tail -5 "$OUT/stderr.log" 2>/dev/null || true
