#!/usr/bin/env bash
# (Copied from ../shared/gpu-lab/make-bundles.sh; b2 also carries embedserve's own deps.)
# Builds wheel bundles that bring SGLang 0.5.17 + FlashInfer 0.6.15 onto an
# offline GPU host whose Python 3.12 already has torch 2.11.0+cu130 (and
# numpy, triton, safetensors, aiohttp, psutil, requests, ...). Each bundle
# stays under 60 MiB so that it can be moved in one transfer of at most 64 MiB.
# Usage: make-bundles.sh OUT_DIR     (needs a package index; run on the dev box)
set -euo pipefail
OUT=${1:?usage: make-bundles.sh OUT_DIR}
mkdir -p "$OUT"/{b1,b2,b3}
TMP=$(mktemp -d)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64)
dl() { local dest=$1; shift; pip download -q --no-deps "${PLAT[@]}" -d "$dest" "$@"; }

# b1: the engine itself, FlashInfer, and the server stack
dl "$OUT/b1" sglang==0.5.17 flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11 \
  fastapi starlette pydantic pydantic-core uvicorn orjson msgspec pyzmq setproctitle \
  python-multipart pybase64 partial-json-parser interegular typing-inspection annotated-types
# sgl_kernel: only the Hopper (sm90) build of common_ops plus the Python sources;
# the full wheel is 380 MB, mostly FA3 / FlashMLA kernels an embedding server never loads.
dl "$TMP" sglang-kernel==0.4.5
( cd "$TMP" && mkdir sk && cd sk && unzip -q ../sglang_kernel-0.4.5-*.whl \
    -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/infllm_ops*' 'sgl_kernel/sm100/*' 'sgl_kernel/flashmla_ops.abi3.so' \
  && tar czf "$OUT/b1/sgl_kernel_sm90.tgz" . )

# b2: grammar backend (imported by SGLang's request schema), the OpenAI protocol types,
# and what embedserve itself needs beyond b1 and the host (pydantic-settings, python-dotenv,
# httptools)
dl "$OUT/b2" xgrammar==0.2.1 openai==2.6.1 jiter distro sniffio docstring-parser \
  pydantic-settings python-dotenv httptools==0.9.0

# b3: transformers pinned to what SGLang 0.5.17 expects (the host's 5.17 clashes on
# 'qwen3_asr'), and the remaining modules SGLang imports at start-up
dl "$OUT/b3" transformers==5.12.1 tokenizers==0.22.2 \
  ipython traitlets decorator matplotlib-inline jedi parso prompt-toolkit wcwidth pexpect \
  ptyprocess stack-data asttokens executing pure-eval ipython-pygments-lexers \
  zstandard compressed-tensors gguf anthropic blobfile pycryptodomex easydict watchfiles \
  torch-memory-saver llguidance dill openai-harmony soundfile cffi pycparser loguru \
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common \
  opentelemetry-proto importlib-metadata googleapis-common-protos \
  jsonschema jsonschema-specifications referencing rpds-py
rm -rf "$TMP"
du -sh "$OUT"/b*
for b in "$OUT"/b*; do
  s=$(du -sm "$b" | cut -f1); [ "$s" -lt 60 ] || { echo "bundle $b is ${s} MiB (limit 60)"; exit 1; }
done
