#!/usr/bin/env bash
# Build the gateway and CPU-engine images from this checkout, as compose.yaml names them:
#
#   deploy/docker/build-images.sh          # embedserve/gateway:VERSION, embedserve/engine-cpu:VERSION
#
# Environment, all optional:
#   EMBEDSERVE_REGISTRY, EMBEDSERVE_TAG  image names (as in compose.yaml: embedserve, and the
#                  package version in pyproject.toml)
#   PYTHON_IMAGE   the base image. Unset: the Dockerfiles' default (python:3.11.13-slim-bookworm)
#                  when it is present or can be pulled; otherwise a Debian bookworm base with
#                  Debian's Python 3.11, built here with debootstrap once and kept as
#                  embedserve-base/python:3.11-bookworm
#   TORCH_WHEELS   a folder holding torch's CPU wheel: served on 127.0.0.1 for the build, torch
#                  is taken from there and its dependencies from the default index
#   TORCH_INDEX    otherwise, the index torch comes from (default PyTorch's CPU index)
#   DEBIAN_MIRROR  for the debootstrap base (default: apt's first source, else deb.debian.org)
#
# Builds run with host networking (a wheel server on 127.0.0.1 is reachable). The context is
# the checkout less each Dockerfile's .dockerignore (deploy/docker/context.py), so the classic
# builder and BuildKit get the same files. Docker's layer cache makes a rebuild after a
# source change reinstall only our package: torch and the pinned dependencies are layers of
# their own.
set -euo pipefail
cd "$(dirname "$0")/../.."

REGISTRY=${EMBEDSERVE_REGISTRY:-embedserve}
# the package's version, the one source of image tags (tests/test_docs.py checks the rest)
TAG=${EMBEDSERVE_TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)}
OFFICIAL=$(sed -n 's/^ARG PYTHON_IMAGE=//p' deploy/docker/Dockerfile.gateway)
LOCAL_BASE=embedserve-base/python:3.11-bookworm

log() { printf '%s %s\n' "$(date +%T)" "$*" >&2; }

cleanup() {
  if [[ -n ${WHEEL_SERVER:-} ]]; then kill "$WHEEL_SERVER" 2>/dev/null || true; fi
  if [[ -n ${ROOTFS:-} ]]; then rm -rf "$ROOTFS"; fi
}
trap cleanup EXIT

debian_mirror() {
  if [[ -n ${DEBIAN_MIRROR:-} ]]; then echo "$DEBIAN_MIRROR"; return; fi
  local m
  m=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
      | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n1 | tr -d ' ' || true)
  echo "${m:-http://deb.debian.org/debian}"
}

# A base image from Debian's packages: bookworm's python3 is 3.11, the official image's minor.
# It trusts this machine's CA bundle (pip's too), so a build behind a TLS-inspecting proxy
# reaches the index.
build_debian_base() {
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  fi
  ROOTFS=$(mktemp -d)
  local mirror
  mirror=$(debian_mirror)
  log "debootstrap bookworm from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$ROOTFS" "$mirror" >"$ROOTFS.log" 2>&1 || { tail -20 "$ROOTFS.log" >&2; exit 1; }
  rm -f "$ROOTFS.log"
  if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
  fi
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$ROOTFS/etc/pip.conf"
  rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*
  tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$ROOTFS"
  ROOTFS=
}

choose_base() {
  if [[ -n ${PYTHON_IMAGE:-} ]]; then
    docker image inspect "$PYTHON_IMAGE" >/dev/null 2>&1 || docker pull -q "$PYTHON_IMAGE" >/dev/null
    echo "$PYTHON_IMAGE"
  elif docker image inspect "$OFFICIAL" >/dev/null 2>&1 || docker pull -q "$OFFICIAL" >/dev/null 2>&1; then
    echo "$OFFICIAL"
  else
    if ! docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
      log "$OFFICIAL cannot be pulled: building $LOCAL_BASE from Debian's packages"
      build_debian_base
    fi
    echo "$LOCAL_BASE"
  fi
}

# A port for the wheel server: a fixed one, so that the torch layer's build argument, and so its
# cache entry, stays the same from one build to the next; another only if that one is taken.
wheel_port() {
  python3 -c 'import socket; s = socket.socket()
try: s.bind(("127.0.0.1", 38537))
except OSError: s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

SECONDS=0
BASE=$(choose_base)
docker run --rm --network none "$BASE" python -c \
  'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "$BASE has no Python 3.11 on its PATH as 'python'" >&2; exit 1; }
log "base image: $BASE ($(docker run --rm --network none "$BASE" python -V 2>&1); ${SECONDS} s)"

ARGS=(--network host --build-arg "PYTHON_IMAGE=$BASE")
LOGS=build/docker
mkdir -p "$LOGS"
TORCH_ARGS=()
if [[ -n ${TORCH_WHEELS:-} ]]; then
  ls "$TORCH_WHEELS"/torch-*.whl >/dev/null || { echo "no torch wheel in $TORCH_WHEELS" >&2; exit 1; }
  port=$(wheel_port)
  python3 -m http.server --bind 127.0.0.1 --directory "$TORCH_WHEELS" "$port" >/dev/null 2>&1 &
  WHEEL_SERVER=$!
  for _ in $(seq 50); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
    sleep 0.1
  done
  TORCH_ARGS+=(--build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$port/")
  log "torch from $TORCH_WHEELS (served on 127.0.0.1:$port)"
elif [[ -n ${TORCH_INDEX:-} ]]; then
  TORCH_ARGS+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
fi

build() {  # build NAME [extra docker build args...]
  local name=$1 dockerfile=deploy/docker/Dockerfile.$1 image=$REGISTRY/$1:$TAG start=$SECONDS
  shift
  log "building $image"
  if ! python3 deploy/docker/context.py "$dockerfile" \
    | docker build "${ARGS[@]}" "$@" -f "$dockerfile" -t "$image" - >"$LOGS/$name.log" 2>&1; then
    tail -n 40 "$LOGS/$name.log" >&2
    echo "building $image failed; the whole log: $LOGS/$name.log" >&2
    exit 1
  fi
  local bytes
  bytes=$(docker image inspect -f '{{.Size}}' "$image")
  log "built $image: $((bytes / 1000000)) MB in $((SECONDS - start)) s"
}

build gateway
build engine-cpu "${TORCH_ARGS[@]}"
log "both images built in ${SECONDS} s"
