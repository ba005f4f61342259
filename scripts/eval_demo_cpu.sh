#!/usr/bin/env bash
# Evaluate the shipped demo family on the CPU (greedy, fp32, the shipped test split) and check
# that speculation is lossless: every speculative run must give the same answers as its target
# alone, question for question.
#
#   bash scripts/eval_demo_cpu.sh                # all 500 shipped test questions
#   EVAL_N=200 EVAL_BS=50 bash scripts/eval_demo_cpu.sh
#
# Writes to $OUT (default eval_out/): <run>.json (the eval's JSON line), <run>.jsonl (every
# output, --save-outputs), <run>.png (accept-length plots), widths.png (accept length against
# verify width), eval_demo_cpu.log, summary.txt (scripts/eval_demo_summary.py).
# Knobs (env): EVAL_N (500), EVAL_BS (50), OMP_NUM_THREADS (1), WIDTHS ("2 3 4 5 6 7": extra
# verify widths tried for DFlash and DSpark), EVAL_N_BS1 (50: questions of the batch-1 runs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-$PWD/eval_out}
N=${EVAL_N:-500}; BS=${EVAL_BS:-50}; WIDTHS=${WIDTHS:-2 3 4 5 6 7}
F=blockspec/demo_family
mkdir -p "$OUT"
exec > >(tee -a "$OUT/eval_demo_cpu.log") 2>&1
git log -1 --format='commit %H %s' 2>/dev/null || true
python3 -c "import torch, sys, os; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cpus', os.cpu_count(), 'threads', torch.get_num_threads())"

run() {  # name [eval flags...]
  local name=$1; shift
  local t0=$(date +%s.%N)
  python3 -m blockspec.cli eval gsm8k --device cpu --dtype float32 --num-questions "$N" \
    --batch-size "$BS" --json --save-outputs "$OUT/$name.jsonl" "$@" > "$OUT/$name.out" 2>&1
  local rc=$?
  local t1=$(date +%s.%N)
  tail -n 1 "$OUT/$name.out" > "$OUT/$name.json"
  printf '%-26s exit %d  %6.1f s  ' "$name" "$rc" "$(echo "$t1 - $t0" | bc)"
  grep -v '^{' "$OUT/$name.out" | tr '\n' ' '; echo
}
spec() {  # name target draft algorithm [width] [--plot]
  local name=$1 target=$2 draft=$3 algo=$4 width=${5:-} plot=${6:-}
  run "$name" --model-path "$F/$target" --speculative-algorithm "$algo" \
    --speculative-draft-model-path "$F/$draft" ${width:+--speculative-num-draft-tokens $width} \
    ${plot:+--plot "$OUT/$name.png"}
}

run default                       # no --model-path: the family target with DFLASH (README)
run target --model-path "$F/target"
run target_mixed --model-path "$F/target_mixed"
spec dflash target dflash DFLASH "" plot
spec dspark target dspark DSPARK "" plot
spec dflash_nvfp4 target dflash_nvfp4 DFLASH "" plot
spec dspark_nvfp4 target dspark_nvfp4 DSPARK "" plot
spec mixed_dflash_nvfp4 target_mixed dflash_nvfp4 DFLASH
spec mixed_dspark_nvfp4 target_mixed dspark_nvfp4 DSPARK
for w in $WIDTHS; do
  spec "dflash_w$w" target dflash DFLASH "$w"
  spec "dspark_w$w" target dspark DSPARK "$w"
done
# one request at a time (batch 1), the first $N1 questions: where speculation saves wall time
N1=${EVAL_N_BS1:-50}
N=$N1 BS=1 run bs1_target --model-path "$F/target"
N=$N1 BS=1 spec bs1_dflash target dflash DFLASH
N=$N1 BS=1 spec bs1_dspark target dspark DSPARK

python3 scripts/eval_demo_summary.py "$OUT" "$OUT/widths.png" | tee "$OUT/summary.txt"
