#!/usr/bin/env bash
# Overload run on the CPU stack: closed loop to measure capacity (16 requests of 32 tokens in
# flight = the admission bound of 512 tokens, so coalescing is as good as it gets), then an
# open loop at 3x that rate.
# Usage: results/overload-cpu/run.sh [OUT_DIR]   (from the repo root, venv active)
set -euo pipefail
OUT_DIR=${1:-results/overload-cpu}
WORK=$(mktemp -d)
GW=18500; ENG=18501
MODEL=$(python -c "from embedserve.config import BUNDLED_MODEL, resolve_model_path; print(resolve_model_path(BUNDLED_MODEL))")
export HF_HUB_OFFLINE=1 EMBEDSERVE_ENGINE__KIND=cpu EMBEDSERVE_GATEWAY__PORT=$GW EMBEDSERVE_ENGINE__PORT=$ENG \
  EMBEDSERVE_ENGINE__STATS_DIR=$WORK/stats EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT=${MAX_TOKENS_IN_FLIGHT:-512} \
  EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S=30 EMBEDSERVE_HEALTH__SAMPLE_INTERVAL_S=1
setsid python -m embedserve up > "$WORK/stack.log" 2>&1 &
STACK=$!
trap 'kill -TERM $STACK 2>/dev/null; wait $STACK 2>/dev/null || true' EXIT
until grep -q "embedserve is up" "$WORK/stack.log"; do sleep 0.5; done
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
COMMON=(--tokenizer "$MODEL" --mix fixed:32 --inputs 1 --encoding-format base64 --no-progress --no-plots
        --watch-pid "$STACK" --sample-interval 1 --timeout 60)
python -m embedserve.loadtest.cli "http://127.0.0.1:$GW" "${COMMON[@]}" --concurrency "${CAP_CONCURRENCY:-16}" \
  --duration "${CAP_S:-30}" --warmup 5 --out "$WORK/capacity"
RATE=$(python -c "import json;d=json.load(open('$WORK/capacity/results.json'));print(round(3*d['measured']['requests_per_s'],2))")
echo "capacity x3 = $RATE req/s"
python -m embedserve.loadtest.cli "http://127.0.0.1:$GW" "${COMMON[@]}" --rate "$RATE" --max-in-flight 100000 \
  --retries-429 0 --duration "${OVER_S:-60}" --warmup 5 --out "$WORK/overload"
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
mkdir -p "$OUT_DIR"
printf '{"cores": %s, "loadavg_before": "%s", "loadavg_after": "%s", "max_tokens_in_flight": %s, "rate_req_s": %s}\n' \
  "$(nproc)" "$LOAD_BEFORE" "$LOAD_AFTER" "$EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT" "$RATE" > "$OUT_DIR/machine.json"
cp "$WORK/capacity/results.json" "$OUT_DIR/capacity.json"; cp "$WORK/capacity/summary.md" "$OUT_DIR/capacity.md"
cp "$WORK/overload/results.json" "$OUT_DIR/overload.json"; cp "$WORK/overload/summary.md" "$OUT_DIR/overload.md"
curl -s "http://127.0.0.1:$GW/metrics" | grep -E '^embedserve_(requests_total|rejected|client_disconnects)' > "$OUT_DIR/metrics.txt" || true
grep -c '"status": 5' "$WORK/stack.log" > "$OUT_DIR/stack_5xx_lines.txt" || true
grep -c '"level": "error"' "$WORK/stack.log" > "$OUT_DIR/stack_error_lines.txt" || true
