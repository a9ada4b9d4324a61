#!/usr/bin/env bash
# On the GPU host: install one bundle (a folder of wheels, maybe with sgl_kernel_sm90.tgz)
# into SITE (default /tmp/site). Run once per bundle, in any order, one bundle per device
# call (each transfer is limited to 64 MiB); then `export PYTHONPATH=$SITE`.
# With --project, also install this checkout (no deps) so that SGLang's plugin loader
# finds our entry point (group sglang.srt.plugins) through its dist-info.
set -euo pipefail
B=${1:?usage: stage.sh BUNDLE_DIR|--project [SITE]}; SITE=${2:-/tmp/site}
PY=${PYTHON:-python3}
mkdir -p "$SITE"
if [ "$B" = "--project" ]; then
  ROOT=$(cd "$(dirname "$0")/../.." && pwd)
  ( cd "$ROOT" && PIP_NO_INDEX=1 $PY -m pip install -q --no-index --no-deps --no-build-isolation \
      --no-compile --upgrade --target "$SITE" . 2>&1 | grep -v "already exists" || true )
  PYTHONPATH=$SITE $PY - <<'PY'
from importlib.metadata import entry_points
eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "embedserve"]
assert eps, "embedserve entry point not visible"
print("entry point:", eps[0].value, "from", eps[0].dist.name)
PY
  exit 0
fi
ls "$B"/*.whl >/dev/null
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$B"/*.whl 2>&1 \
  | grep -v "already exists" || true
if [ -f "$B/sgl_kernel_sm90.tgz" ]; then tar xzf "$B/sgl_kernel_sm90.tgz" -C "$SITE"; fi
# a FlashInfer JIT cache an earlier visit brought back (lab.py's stop-all step packs it)
if [ -f "$B/fi-cache.tgz" ]; then
  CACHE=${LAB_FI_CACHE:-/tmp/fi-cache}
  mkdir -p "$CACHE" && tar xzf "$B/fi-cache.tgz" -C "$CACHE"
  # FlashInfer builds through ninja, which compares mtimes: pip gave the headers and sources
  # it compiles from (b1) the time of staging, newer than the cached objects, so every kernel
  # was compiled again (301 s cold start with the cache, 2026-11-30). Touching the cache
  # instead does not help: outputs newer than .ninja_deps records also count as dirty.
  # So the inputs get an old time (2000-01-01); `ninja -n` in each op dir: "no work to do".
  if [ -d "$SITE/flashinfer" ]; then
    find "$SITE/flashinfer" "$SITE/tvm_ffi" -type f -exec touch -c -d @946684800 {} + 2>/dev/null || true
  else
    echo "warning: FlashInfer is not staged yet (stage b1 first), so the cache will be rebuilt" >&2
  fi
fi
echo "staged $B into $SITE ($(ls "$SITE" | wc -l) entries)"
