#!/usr/bin/env bash
# Train the whole demo family (target, DFlash, DSpark, Nemotron-3.5-layout W4A16_NVFP4 drafts,
# MIXED_PRECISION target) from a fresh checkout within one wall-clock budget, quick-evaluate it,
# and pack it for shipping.
#
#   bash scripts/train_demo.sh                     # CUDA run (H200: ~8 min)
#   BLOCKSPEC_DEMO_SMOKE=1 bash scripts/train_demo.sh   # CPU dry run: tiny models, seconds each
#
# Every stage is time-budgeted (the trainers stop cleanly and save when their seconds are used)
# and wrapped in `timeout`, so the script ends in budget whatever the throughput.  Writes to $OUT:
#   train_demo.log                  everything printed (training lines, eval JSON)
#   results.json                    the quick-eval JSON objects, one per line
#   demo_family.tar.gz.partNN       the family (blockspec/demo_family/<member>/...), split in
#                                   15 MiB parts: cat demo_family.tar.gz.part* | tar -xz
# Knobs (env): DEMO_TOTAL_S (deadline for everything before packing, default 460),
# DEMO_TARGET_MAX_S (300), DEMO_DRAFT_S (60), DEMO_EVAL_S (60), DEMO_TRAIN_SAMPLES (300000),
# DEMO_INIT_TARGET (a target checkpoint to continue training from, e.g. an unpacked
# blockspec/demo_family/target: `train-target --init-from`; the drafts are then retrained on it).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
OUT=${OUT:-$PWD/demo_out}
WORK=${DEMO_WORK:-$(mktemp -d /tmp/blockspec_demo.XXXX)}
FAM=$WORK/demo_family
mkdir -p "$OUT" "$FAM" "$WORK/data" "$WORK/eval"
LOG=$OUT/train_demo.log
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
PY="python3 -m blockspec.cli"
START=$(date +%s)

if [ "${BLOCKSPEC_DEMO_SMOKE:-0}" = 1 ]; then
  TOTAL=${DEMO_TOTAL_S:-420}; TARGET_MAX=${DEMO_TARGET_MAX_S:-25}; DRAFT_S=${DEMO_DRAFT_S:-10}
  EVAL_S=${DEMO_EVAL_S:-240}; SAMPLES=${DEMO_TRAIN_SAMPLES:-3000}; SIZE=tiny
  T_BATCH=16; D_BATCH=8; ANCHORS=8; EVAL_N=4; EVAL_SPEC_N=2; MAX_NEW=8; DEVICE=cpu
else
  TOTAL=${DEMO_TOTAL_S:-460}; TARGET_MAX=${DEMO_TARGET_MAX_S:-300}; DRAFT_S=${DEMO_DRAFT_S:-60}
  EVAL_S=${DEMO_EVAL_S:-60}; SAMPLES=${DEMO_TRAIN_SAMPLES:-300000}; SIZE=demo
  T_BATCH=256; D_BATCH=64; ANCHORS=32; EVAL_N=200; EVAL_SPEC_N=64; MAX_NEW=256; DEVICE=auto
fi
DEADLINE=$((START + TOTAL))
left() { echo $((DEADLINE - $(date +%s))); }
stage() { echo; echo "=== [$(( $(date +%s) - START ))s] $*"; }

stage "setup: out=$OUT work=$WORK smoke=${BLOCKSPEC_DEMO_SMOKE:-0} deadline in $(left)s"
git log -1 --format='commit %H %s' 2>/dev/null || true
python3 -c "import torch, tokenizers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true

stage "data: $SAMPLES train problems; the shipped test split must be reproduced exactly"
timeout 120 python3 -m blockspec.gsm8k_data.generator --out "$WORK/data" --train "$SAMPLES" --test 500
cmp -s "$WORK/data/test.jsonl" blockspec/gsm8k_data/gsm8k_demo_test.jsonl \
  && echo "test split: identical to blockspec/gsm8k_data/gsm8k_demo_test.jsonl" \
  || echo "WARNING: generated test split differs from the shipped one"

# the target gets what the later stages do not need
RESERVE=$((DRAFT_S + 40 + EVAL_S + 25))
TARGET_S=$(( $(left) - RESERVE - 30 ))
[ "$TARGET_S" -gt "$TARGET_MAX" ] && TARGET_S=$TARGET_MAX
[ "$TARGET_S" -lt 5 ] && TARGET_S=5
stage "target: train-target --size $SIZE for ${TARGET_S}s"
timeout $((TARGET_S + 120)) $PY train-target --output "$FAM/target" --data "$WORK/data/train.jsonl" \
  --num-samples "$SAMPLES" --size "$SIZE" --time-budget-s "$TARGET_S" --batch-size "$T_BATCH" \
  --save-every-s 60 --device "$DEVICE" ${DEMO_INIT_TARGET:+--init-from "$DEMO_INIT_TARGET"}
echo "train-target exit $?"

stage "drafts (4 in parallel, ${DRAFT_S}s each) + MIXED_PRECISION target"
draft() {  # name algorithm layout [extra...]
  local name=$1 algo=$2 layout=$3; shift 3
  timeout $((DRAFT_S + 100)) $PY train-draft --target-model-path "$FAM/target" --algorithm "$algo" \
    --layout "$layout" --output "$FAM/$name" --data "$WORK/data/train.jsonl" --num-samples 100000 \
    --size "$SIZE" --time-budget-s "$DRAFT_S" --batch-size "$D_BATCH" --num-anchors "$ANCHORS" \
    --device "$DEVICE" "$@" > "$WORK/$name.log" 2>&1
  echo "train-draft $name exit $?"
}
# (explicit pids: a bare `wait` would also wait for the log's `tee`)
pids=()
draft dflash dflash generic --block-size 8 & pids+=($!)
draft dspark dspark generic --block-size 7 & pids+=($!)
draft dflash_nvfp4 dflash nemotron35 --block-size 8 --quantize W4A16_NVFP4 & pids+=($!)
draft dspark_nvfp4 dspark nemotron35 --block-size 7 --quantize W4A16_NVFP4 & pids+=($!)
timeout 120 $PY quantize --model-path "$FAM/target" --output "$FAM/target_mixed" \
  --quant-algo MIXED_PRECISION --recipe lightning
echo "quantize exit $?"
wait "${pids[@]}"
for n in dflash dspark dflash_nvfp4 dspark_nvfp4; do echo "--- $n"; grep -v "Warning\|warn(" "$WORK/$n.log" | tail -n 12; done

E=$(( $(left) )); [ "$E" -gt "$EVAL_S" ] && E=$EVAL_S; [ "$E" -lt 20 ] && E=20
stage "quick eval (parallel, ${E}s limit): target $EVAL_N questions, drafts $EVAL_SPEC_N each"
evaluate() {  # name N [engine flags...]
  local name=$1 n=$2; shift 2
  timeout "$E" $PY eval gsm8k --num-questions "$n" --batch-size "$n" --max-new-tokens "$MAX_NEW" \
    --max-total-tokens $((n * (MAX_NEW + 160))) --device "$DEVICE" --json --save-outputs "$WORK/eval/$name.jsonl" "$@" > "$WORK/eval/$name.log" 2>&1
  echo "eval $name exit $?"
}
T=$FAM/target
pids=()
evaluate target "$EVAL_N" --model-path "$T" & pids+=($!)
evaluate target_mixed "$EVAL_SPEC_N" --model-path "$FAM/target_mixed" & pids+=($!)
evaluate dflash "$EVAL_SPEC_N" --model-path "$T" --speculative-algorithm DFLASH \
  --speculative-draft-model-path "$FAM/dflash" --plot "$OUT/dflash.png" & pids+=($!)
evaluate dspark "$EVAL_SPEC_N" --model-path "$T" --speculative-algorithm DSPARK \
  --speculative-draft-model-path "$FAM/dspark" --plot "$OUT/dspark.png" & pids+=($!)
evaluate dflash_nvfp4 "$EVAL_SPEC_N" --model-path "$T" --speculative-algorithm DFLASH \
  --speculative-draft-model-path "$FAM/dflash_nvfp4" & pids+=($!)
evaluate dspark_nvfp4 "$EVAL_SPEC_N" --model-path "$T" --speculative-algorithm DSPARK \
  --speculative-draft-model-path "$FAM/dspark_nvfp4" & pids+=($!)
wait "${pids[@]}"
: > "$OUT/results.json"
for n in target target_mixed dflash dspark dflash_nvfp4 dspark_nvfp4; do
  echo "--- eval $n"; grep -v "Warning\|warn(" "$WORK/eval/$n.log" | tail -n 4
  last=$(tail -n 1 "$WORK/eval/$n.log")
  case "$last" in "{"*) echo "{\"member\": \"$n\", \"result\": $last}" >> "$OUT/results.json";; esac
done
python3 - "$WORK/eval" <<'EOF' || true
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
def preds(n):
    f = d / f"{n}.jsonl"
    return [json.loads(l)["pred"] for l in f.open()] if f.is_file() else None
base = preds("target")
for n in ("dflash", "dspark", "dflash_nvfp4", "dspark_nvfp4", "target_mixed"):
    p = preds(n)
    if base is None or p is None:
        continue
    same = sum(a == b for a, b in zip(base, p))
    print(f"answers {n} vs target (first {len(p)}): {same}/{len(p)} identical")
EOF

stage "pack"
rm -f "$FAM"/*/train_state.pt
du -sh "$FAM"/* 2>/dev/null
tar -C "$WORK" -czf "$WORK/demo_family.tar.gz" demo_family
ls -l "$WORK/demo_family.tar.gz"
rm -f "$OUT"/demo_family.tar.gz.part*
split -b 15M -d -a 2 "$WORK/demo_family.tar.gz" "$OUT/demo_family.tar.gz.part"
ls -l "$OUT"
stage "done in $(( $(date +%s) - START ))s"
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null || true
