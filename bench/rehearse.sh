#!/usr/bin/env bash
# CPU rehearsal of one lab visit (docs/LAB-RUNBOOK.md): the runbook's lab.py commands with a
# tiny checkpoint and the CPU engine in SGLang's place, durations x LAB_TIME_SCALE, `run`
# repeated with a short budget like the device calls, until every step is done.
# Usage: loadtest/gpu_lab/rehearse.sh soak|perf|perf-recheck|scale     (from the repo root, venv active)
set -euo pipefail
VISIT=${1:?usage: rehearse.sh soak|perf|perf-recheck|scale}
export LAB_DEVICE=cpu LAB_CAP=${LAB_CAP:-512} LAB_TIME_SCALE=${LAB_TIME_SCALE:-0.05}
export LAB_DIR=${LAB_DIR:-/tmp/lab-rehearsal/$VISIT}; export OUT=${OUT:-$LAB_DIR-out}
PY=${PYTHON:-python3}; LAB="$PY loadtest/gpu_lab/lab.py"
rm -rf "$LAB_DIR" "$OUT"
if [[ "$VISIT" == perf* ]]; then
  export LAB_SWEEP=${LAB_SWEEP:-2:0,8:2,4:5}
  $LAB models && $LAB launch --wait-models-s 300
else
  $LAB models --shapes 4b
fi
for call in 1 2 3 4 5 6 7 8; do
  echo "== call $call"
  $LAB run --visit "$VISIT" --budget-s "${LAB_CALL_S:-90}" >/dev/null
  if $LAB pending --visit "$VISIT"; then break; fi
done
$LAB pending --visit "$VISIT" && ls "$OUT" && echo "rehearsal of $VISIT passed: $LAB_DIR/results.md"
