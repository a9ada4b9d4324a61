#!/usr/bin/env bash
# On a GPU host with no package index: install one bundle (a folder of wheels from
# make-bundles.sh, maybe with sgl_kernel_sm90.tgz and fi-cache.tgz) into SITE, one bundle per
# transfer, in the order b1, b2, b3 (b4, the Infinity peer, goes to its own folder; the FA3
# parts fa3/pNN after b1, in any order; vLLM's parts vllm/pNN after b3, in any order, into
# /tmp/site-vllm). Then `export PYTHONPATH=/tmp/site`. SITE defaults to /tmp/site, or
# /tmp/site-infinity for b4.
# `stage.sh --project [SITE]` builds embedserve's wheel from this checkout and installs it, so
# that SGLang's plugin loader finds our entry point (group sglang.srt.plugins) next to SGLang.
set -euo pipefail
B=${1:?usage: stage.sh BUNDLE_DIR|--project [SITE]}
SITE=${2:-/tmp/site}
if [ -z "${2:-}" ] && [ -f "$B/SITE_SUFFIX" ]; then SITE=/tmp/site-$(cat "$B/SITE_SUFFIX"); fi
PY=${PYTHON:-python3}
mkdir -p "$SITE"
install_wheels() {
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$@" 2>&1 \
    | grep -v "already exists" || true
}

if [ "$B" = "--project" ]; then
  ROOT=$(cd "$(dirname "$0")/../.." && pwd)
  # An embedserve installed earlier (b2's wheel, or an older checkout) goes first, file by file
  # from its RECORD: pip cannot uninstall from a --target folder, and a second dist-info would
  # register a second SGLang plugin.
  $PY - "$SITE" <<'PY'
import csv, shutil, sys
from pathlib import Path
site = Path(sys.argv[1])
folders = set()
for info in site.glob("embedserve-*.dist-info"):
    for row in csv.reader((info / "RECORD").read_text().splitlines()):
        if row and not row[0].startswith(".."):
            (site / row[0]).unlink(missing_ok=True)
            folders.add((site / row[0]).parent)
    shutil.rmtree(info, ignore_errors=True)
for folder in sorted(folders, key=lambda p: -len(p.parts)):  # the package folders left empty
    shutil.rmtree(folder / "__pycache__", ignore_errors=True)
    if folder.is_dir() and folder != site and not any(folder.iterdir()):
        folder.rmdir()
PY
  WHEELS=$(mktemp -d)
  ( cd "$ROOT" && PIP_NO_INDEX=1 $PY -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" . )
  install_wheels "$WHEELS"/embedserve-*.whl
  rm -rf "$WHEELS"
  PYTHONPATH=$SITE $PY - <<'PY'
from importlib.metadata import entry_points
eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "embedserve"]
assert eps, "embedserve entry point not visible"
print("entry point:", eps[0].value, "from", eps[0].dist.name)
PY
  exit 0
fi

# A file that travels in parts (make-bundles.sh: fa3/pNN, vllm/pNN), staged in any order: each
# part waits in PARTS until all COUNT have come (MARKER holds "COUNT SHA256"); the last one
# joins them into PARTS/NAME and checks its SHA-256. Returns 1 while parts are missing.
join_parts() {  # MARKER NAME PARTS
  local count sum have
  read -r count sum < "$B/$1"
  mkdir -p "$3" && cp "$B/$2".part* "$3/"
  have=$(find "$3" -name "$2.part*" | wc -l)
  if [ "$have" -lt "$count" ]; then
    echo "staged part $(basename "$B") of $2: $have of $count"
    return 1
  fi
  cat "$3/$2".part* > "$3/$2"
  echo "$sum  $3/$2" | sha256sum -c --quiet - || { echo "the parts of $2 do not add up" >&2; exit 1; }
}

if [ -f "$B/VLLM_PARTS" ]; then
  # vLLM 0.26.0: unpacked into SITE (/tmp/site-vllm unless given), with the wheels that came
  # with a part installed next to it
  [ -n "${2:-}" ] || SITE=/tmp/site-vllm
  PARTS=${VLLM_PARTS_DIR:-/tmp/vllm-parts}
  mkdir -p "$PARTS" "$SITE"
  if ls "$B"/*.whl >/dev/null 2>&1; then cp "$B"/*.whl "$PARTS/"; fi
  join_parts VLLM_PARTS vllm.tar.xz "$PARTS" || exit 0
  if command -v xz >/dev/null; then
    tar xJf "$PARTS/vllm.tar.xz" -C "$SITE"
  else  # no xz binary: Python's lzma reads it
    $PY -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$PARTS/vllm.tar.xz" "$SITE"
  fi
  install_wheels "$PARTS"/*.whl
  rm -rf "$PARTS"
  PYTHONPATH=$SITE:${PYTHONPATH:-} $PY -c 'import vllm, flashinfer; print("vllm", vllm.__version__, "flashinfer", flashinfer.__version__, "from", vllm.__file__)'
  exit 0
fi

if [ -f "$B/FA3_PARTS" ]; then
  # SGLang's FA3 kernels, into SITE/sgl_kernel
  PARTS=${FA3_PARTS_DIR:-/tmp/fa3-parts}
  join_parts FA3_PARTS flash_ops.so.gz "$PARTS" || exit 0
  mkdir -p "$SITE/sgl_kernel"
  gunzip -c "$PARTS/flash_ops.so.gz" > "$SITE/sgl_kernel/flash_ops.abi3.so"
  rm -rf "$PARTS"
  echo "staged SGLang's FA3 kernels into $SITE/sgl_kernel/flash_ops.abi3.so"
  exit 0
fi

ls "$B"/*.whl >/dev/null
install_wheels "$B"/*.whl
if [ -f "$B/sgl_kernel_sm90.tgz" ]; then tar xzf "$B/sgl_kernel_sm90.tgz" -C "$SITE"; fi
# A FlashInfer JIT cache packed by an earlier run of the suite (bench/suite.py writes
# fi-cache.tgz next to its results): put it in a bundle folder staged after b1.
if [ -f "$B/fi-cache.tgz" ]; then
  CACHE=${FI_CACHE_DIR:-/tmp/fi-cache}
  mkdir -p "$CACHE" && tar xzf "$B/fi-cache.tgz" -C "$CACHE"
  # FlashInfer builds through ninja, which compares mtimes: pip gives the headers and sources
  # it compiles from (b1) the time of staging, newer than the cached objects, so every kernel
  # would be compiled again (a 301 s cold start with the cache on one H200). Touching the cache
  # instead does not help: outputs newer than .ninja_deps records also count as dirty.
  # So the inputs get an old time (2000-01-01); `ninja -n` in each op dir: "no work to do"
  # (116 s to ready on a fresh host).
  if [ -d "$SITE/flashinfer" ]; then
    find "$SITE/flashinfer" "$SITE/tvm_ffi" -type f -exec touch -c -d @946684800 {} + 2>/dev/null || true
  else
    echo "warning: FlashInfer is not staged yet (stage b1 first), so the cache will be rebuilt" >&2
  fi
fi
echo "staged $B into $SITE ($(find "$SITE" -mindepth 1 -maxdepth 1 | wc -l) entries)"
