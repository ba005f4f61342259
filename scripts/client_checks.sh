#!/usr/bin/env bash
# Runs two real client tools against `blockspec serve` (the shipped demo family, on CPU):
#   1. lm-eval 0.4.13 `local-completions`: a loglikelihood (multiple-choice) task and a
#      generate_until task, both from local files (scripts/lm_eval_tasks/).
#   2. guidellm 0.8.1 `guidellm run`: streaming synthetic benchmark, synchronous, 10 requests,
#      once over /v1/chat/completions (guidellm's default) and once over /v1/completions.
# Starts the server on a free 127.0.0.1 port, prints the figures, stops the server.
#
# The tools live in their own venv (never the project's):
#   python3 -m venv /work/clientenv
#   /work/clientenv/bin/pip install "lm-eval[api]==0.4.13" guidellm==0.8.1
# (lm-eval's API models need the [api] extra: tenacity, aiohttp, tiktoken.)
# Nothing is downloaded: the tokenizer is the demo target folder, the data are local/synthetic.
#
# Env: CLIENT_VENV (default /work/clientenv), PY (project python, default .venv/bin/python),
#      OUT_DIR (default: a new temp dir), PORT (default: a free one).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLIENT_VENV="${CLIENT_VENV:-/work/clientenv}"
PY="${PY:-$ROOT/.venv/bin/python}"
OUT_DIR="${OUT_DIR:-$(mktemp -d /tmp/blockspec_client_checks.XXXXXX)}"
TOK="$ROOT/blockspec/demo_family/target"
TASKS_DIR="$ROOT/scripts/lm_eval_tasks"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=200
mkdir -p "$OUT_DIR"

for tool in lm_eval guidellm; do
    [[ -x "$CLIENT_VENV/bin/$tool" ]] || { echo "missing $CLIENT_VENV/bin/$tool (see the header)" >&2; exit 1; }
done

PORT="${PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
BASE="http://127.0.0.1:$PORT"

echo "== server: blockspec serve --port $PORT (log $OUT_DIR/serve.log)"
(cd "$ROOT" && exec "$PY" -m blockspec serve --host 127.0.0.1 --port "$PORT") > "$OUT_DIR/serve.log" 2>&1 &
SERVER_PID=$!
stop_server() {
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        echo "== server stopped (pid $SERVER_PID)"
    fi
}
trap stop_server EXIT

for _ in $(seq 120); do
    curl -sf "$BASE/health" > /dev/null 2>&1 && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$OUT_DIR/serve.log"; echo "server exited" >&2; exit 1; }
    sleep 1
done
curl -sf "$BASE/health" > /dev/null || { cat "$OUT_DIR/serve.log"; echo "server not healthy" >&2; exit 1; }
MODEL="$(curl -sf "$BASE/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"
echo "== served model: $MODEL"

timed() {  # timed LABEL LOG CMD...: runs CMD (stdout+stderr to LOG), prints its wall time
    local label=$1 log=$2 t0 t1 rc=0
    shift 2
    t0=$(date +%s.%N)
    "$@" > "$log" 2>&1 || rc=$?
    t1=$(date +%s.%N)
    printf '== %s: rc=%d wall %.1f s\n' "$label" "$rc" "$(echo "$t1 - $t0" | bc)"
    return "$rc"
}

# ---- 1. lm-eval ------------------------------------------------------------------------
echo "== lm-eval local-completions: blockspec_arith_mc (loglikelihood), blockspec_gsm8k_demo20 (generate)"
timed lm-eval "$OUT_DIR/lm_eval.log" "$CLIENT_VENV/bin/lm_eval" --model local-completions \
    --model_args "model=$MODEL,base_url=$BASE/v1/completions,tokenizer=$TOK,num_concurrent=1,max_retries=1" \
    --include_path "$TASKS_DIR" \
    --tasks blockspec_arith_mc,blockspec_gsm8k_demo20 \
    --output_path "$OUT_DIR/lm_eval" --log_samples \
    || { tail -40 "$OUT_DIR/lm_eval.log"; exit 1; }
grep '^|' "$OUT_DIR/lm_eval.log"
"$CLIENT_VENV/bin/python" - "$OUT_DIR/lm_eval" <<'EOF'
import glob, json, sys
path = sorted(glob.glob(f"{sys.argv[1]}/*/results_*.json"))[-1]
d = json.load(open(path))
for task, res in d["results"].items():
    n = d["n-samples"][task]["effective"]
    figs = ", ".join(f"{k.split(',')[0]}[{k.split(',')[1]}]={v:.3f}" for k, v in res.items()
                     if "," in k and not k.split(",")[0].endswith("_stderr"))
    print(f"lm-eval {task}: n={n} {figs}")
EOF

# ---- 2. guidellm -----------------------------------------------------------------------
for fmt in /v1/chat/completions /v1/completions; do
    tag=$(echo "$fmt" | tr -c 'a-z0-9\n' '_')
    echo "== guidellm run: $fmt, stream, synthetic 64 in / 32 out, synchronous, 10 requests"
    timed "guidellm $fmt" "$OUT_DIR/guidellm$tag.log" "$CLIENT_VENV/bin/guidellm" run \
        --backend "kind=openai_http,target=$BASE,model=$MODEL,request_format=$fmt" \
        --tokenizer "kind=huggingface_auto,model=$TOK" \
        --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 \
        --profile kind=synchronous \
        --constraint kind=max_requests,count=10 \
        --output "kind=json,path=$OUT_DIR/guidellm$tag.json" --output kind=console \
        --disable-progress \
        || { tail -60 "$OUT_DIR/guidellm$tag.log"; exit 1; }
    grep -B1 -A9 'Request Latency Statistics' "$OUT_DIR/guidellm$tag.log" | tail -9
    "$CLIENT_VENV/bin/python" - "$OUT_DIR/guidellm$tag.json" "$fmt" <<'EOF'
import json, sys
b = json.load(open(sys.argv[1]))["benchmarks"][0]
m = b["metrics"]
ok = lambda k: m[k]["successful"]
tot = m["request_totals"]
print(f"guidellm {sys.argv[2]}: requests ok={tot['successful']} err={tot['errored']} "
      f"incomplete={tot['incomplete']} | TTFT ms mean={ok('time_to_first_token_ms')['mean']:.1f} "
      f"p50={ok('time_to_first_token_ms')['median']:.1f} | ITL ms mean={ok('inter_token_latency_ms')['mean']:.1f} "
      f"p50={ok('inter_token_latency_ms')['median']:.1f} | output tok/s={m['output_tokens_per_second']['successful']['mean']:.1f} "
      f"| output tokens/req={ok('output_token_count')['mean']:.0f}")
if tot["successful"] == 0 or tot["errored"]:
    sys.exit(f"guidellm: {tot['errored']} errored / {tot['successful']} successful requests")
EOF
done

echo "== outputs in $OUT_DIR"
