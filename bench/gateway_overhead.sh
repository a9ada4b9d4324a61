#!/usr/bin/env bash
# The gateway's added latency and throughput cost on the lab host's CPUs, no GPU needed:
# an instant engine answering 2560-dim vectors (the 4B's), a tiny synthetic tokenizer,
# loadtest.bench_gateway_overhead (engine ids vs gateway texts vs gateway ids, alternating).
# Needs bundles b1 and b2 staged and the checkout on PYTHONPATH. Writes bench.json/.md to $OUT.
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORK=${LAB_DIR:-/tmp/lab}/gw-overhead
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
python3 -m service.synthetic tiny "$WORK/model" > "$WORK/synth.log" 2>&1
python3 -m loadtest.instant_engine 30100 2560 > "$WORK/engine.log" 2>&1 &
ENGINE=$!
EMBEDSERVE_MODEL__PATH="$WORK/model" EMBEDSERVE_ENGINE__KIND=external \
EMBEDSERVE_ENGINE__URLS='["http://127.0.0.1:30100"]' EMBEDSERVE_GATEWAY__PORT=8100 \
EMBEDSERVE_LOG_LEVEL=WARNING python3 -m service.cli gateway > "$WORK/gateway.log" 2>&1 &
GATEWAY=$!
trap 'kill $GATEWAY $ENGINE 2>/dev/null || true' EXIT
for _ in $(seq 1 60); do
  curl -sf http://127.0.0.1:8100/health/ready > /dev/null && break
  sleep 0.5
done
nproc
python3 -m loadtest.bench_gateway_overhead --gateway http://127.0.0.1:8100 \
  --engine http://127.0.0.1:30100 --tokenizer "$WORK/model" --mix uniform:16-512 \
  --phase "${PHASE_S:-6}" --rounds 2 --high 64 --out "$OUT"
