#!/usr/bin/env bash
# The README's CPU throughput table: the shipped demo family on all 500 questions of the shipped
# GSM8K-format test split, batch 50, greedy, for the target alone, target + DFlash and
# target + DSpark; each run RUNS times (interleaved, so drift in the machine's load spreads over
# all three), then the median output_throughput, accuracy and accept_length of each and the
# speed-up of the medians over the target alone.
#
#   bash scripts/readme_figures.sh              # from anywhere; run it on a quiet machine
#
# Each run is exactly
#   python -m blockspec eval gsm8k --batch-size 50 --json --speculative-algorithm {NONE,DFLASH,DSPARK}
# Knobs (env): RUNS (5), OUT (readme_figures_out/ in the repository root: every run's output and
# JSON line), PYTHON (python), EXTRA (more eval flags, e.g. "--device cpu"; default none).
# Threads are torch's default unless OMP_NUM_THREADS is set; the header line records them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RUNS=${RUNS:-5}
OUT=${OUT:-$PWD/readme_figures_out}
PY=${PYTHON:-python}
EXTRA=${EXTRA:-}
ALGOS="NONE DFLASH DSPARK"
mkdir -p "$OUT"

git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100 || true
"$PY" -c "import os, sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__,
      '| cpus', os.cpu_count(), '| torch threads', torch.get_num_threads(),
      '| OMP_NUM_THREADS', os.environ.get('OMP_NUM_THREADS', 'unset'),
      '| cuda', torch.cuda.is_available())"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"

for i in $(seq 1 "$RUNS"); do
  for algo in $ALGOS; do
    log="$OUT/${algo}_$i.log"
    # shellcheck disable=SC2086  # EXTRA is a list of flags
    if ! "$PY" -m blockspec eval gsm8k --batch-size 50 --json --speculative-algorithm "$algo" \
        $EXTRA > "$log" 2>&1; then
      echo "run $i $algo failed; the end of $log:" >&2
      tail -n 20 "$log" >&2
      exit 1
    fi
    tail -n 1 "$log" > "$OUT/${algo}_$i.json"
    "$PY" -c "import json, sys; d = json.load(open(sys.argv[1]))
print(f'run {sys.argv[2]} {sys.argv[3]:6s}: {d[\"output_throughput\"]:8.1f} tok/s, '
      f'accuracy {d[\"accuracy\"]:.3f}, accept length {d[\"accept_length\"]:.3f}, '
      f'wall {d[\"wall_s\"]:.1f} s')" "$OUT/${algo}_$i.json" "$i" "$algo"
  done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"

"$PY" - "$OUT" "$RUNS" $ALGOS <<'EOF'
import json
import statistics
import sys
from pathlib import Path

out, runs, algos = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
rows = {a: [json.loads((out / f"{a}_{i}.json").read_text()) for i in range(1, runs + 1)]
        for a in algos}
med = {a: {k: statistics.median(r[k] for r in rs)
           for k in ("output_throughput", "accuracy", "accept_length", "wall_s")}
       for a, rs in rows.items()}
names = {"NONE": "target alone", "DFLASH": "target + DFlash", "DSPARK": "target + DSpark"}
base = med["NONE"]["output_throughput"]
print()
print(f"median of {runs} runs, `python -m blockspec eval gsm8k --batch-size 50 --json "
      f"--speculative-algorithm ALGO`:")
print()
print("| member | output tok/s (median) | min-max | speed-up over target alone | accuracy "
      "| accept length |")
print("|---|---|---|---|---|---|")
for a in algos:
    tp = [r["output_throughput"] for r in rows[a]]
    acc = {r["accuracy"] for r in rows[a]}
    al = med[a]["accept_length"]
    print(f"| {names.get(a, a)} | {med[a]['output_throughput']:.0f} | {min(tp):.0f}-{max(tp):.0f} "
          f"| {med[a]['output_throughput'] / base:.2f}x | {med[a]['accuracy']:.3f}"
          f"{'' if len(acc) == 1 else ' (varied: ' + ', '.join(map(str, sorted(acc))) + ')'} "
          f"| {'—' if not al else f'{al:.2f}'} |")
EOF
