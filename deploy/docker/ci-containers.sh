#!/usr/bin/env bash
# The CPU profile as containers, from images built here, checked end to end. .ci/run calls
# it after the test suite; by hand (as root, or a user of the docker group, with the dev
# venv in .venv): deploy/docker/ci-containers.sh
#
#  1. a Docker engine: the one that answers, else dockerd (Debian's docker.io) started here
#     with no bridge and no iptables rules; if none can be had, it says so and fails
#  2. both images, built by deploy/docker/build-images.sh (its variables apply)
#  3. the engine and the gateway containers as compose.yaml's cpu profile runs them, but with
#     host networking, on 127.0.0.1 and non-default ports: the gateway with a read-only
#     root filesystem and a tmpfs /tmp, the two sharing the stats volume and the engine's
#     PID namespace; each HEALTHCHECK must turn healthy
#  4. the end-to-end tests marked external_stack against the gateway (EMBEDSERVE_E2E_URL):
#     the OpenAI SDK, LangChain and Haystack, bad input, /health/live, ready and memory
#  5. the read-only root filesystem held: writing there fails, the gateway logged no write
#     error, its health history reached its volume
#  6. docker stop drains (tests/test_container_stop.py): requests admitted while the engine
#     is paused all complete with 200, and both containers exit 0
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-.venv/bin/python}
ENGINE_PORT=${EMBEDSERVE_CI_ENGINE_PORT:-30500}
GATEWAY_PORT=${EMBEDSERVE_CI_GATEWAY_PORT:-8500}
REGISTRY=${EMBEDSERVE_REGISTRY:-embedserve}
# the package's version, the one source of image tags (tests/test_docs.py checks the rest)
TAG=${EMBEDSERVE_TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)}
ENGINE=embedserve-ci-engine
GATEWAY=embedserve-ci-gateway
STATS=embedserve-ci-stats
HISTORY=embedserve-ci-health-history
# torch's CPU build: from TORCH_WHEELS or TORCH_INDEX when set; else from a wheel folder
# pip is configured with (find-links) when one holds it; else PyTorch's CPU index.
if [[ -z ${TORCH_WHEELS:-} && -z ${TORCH_INDEX:-} ]]; then
  for dir in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
    if compgen -G "${dir#file://}/torch-*+cpu-*.whl" >/dev/null; then
      export TORCH_WHEELS=${dir#file://}
      break
    fi
  done
fi

log() { printf '%s [containers] %s\n' "$(date +%T)" "$*"; }
fail() { log "FAILED: $*" >&2; exit 1; }

TIMES=()
STEP_NAME=
STEP_START=0
T0=$SECONDS
step() {  # step NAME: ends the running step, starts the next one
  if [[ -n $STEP_NAME ]]; then
    TIMES+=("$(printf '%-38s %4d s' "$STEP_NAME" $((SECONDS - STEP_START)))")
  fi
  STEP_NAME=$1
  STEP_START=$SECONDS
  if [[ -n $1 ]]; then log "== $1"; fi
}

DOCKERD_PID=
remove_containers() {
  docker rm -f "$GATEWAY" "$ENGINE" >/dev/null 2>&1 || true
  docker volume rm "$STATS" "$HISTORY" >/dev/null 2>&1 || true
}
cleanup() {
  local rc=$?
  if [[ $rc -ne 0 ]] && docker inspect "$GATEWAY" >/dev/null 2>&1; then
    log "last lines of the gateway's log:"
    docker logs --tail 30 "$GATEWAY" 2>&1 || true
    log "last lines of the engine's log:"
    docker logs --tail 30 "$ENGINE" 2>&1 || true
  fi
  if docker info >/dev/null 2>&1; then remove_containers; fi
  if [[ -n $DOCKERD_PID ]]; then
    log "stopping the dockerd started here"
    kill "$DOCKERD_PID" 2>/dev/null || true
    wait "$DOCKERD_PID" 2>/dev/null || true
  fi
  exit "$rc"
}
trap cleanup EXIT

docker_answers() { timeout 20 docker info >/dev/null 2>&1; }

ensure_docker() {
  if docker_answers; then
    log "Docker engine: $(docker version -f '{{.Server.Version}}') (already running)"
    return
  fi
  if ! command -v dockerd >/dev/null; then
    [[ $(id -u) -eq 0 ]] || fail "no Docker engine answers, and only root can install one"
    log "no Docker engine answers: installing Debian's docker.io"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends docker.io >/dev/null; } \
      || fail "no Docker engine answers and docker.io could not be installed"
  fi
  command -v docker >/dev/null || fail "dockerd is installed but the docker client is missing"
  log "starting dockerd (log: /var/log/embedserve-ci-dockerd.log)"
  dockerd --host unix:///var/run/docker.sock --iptables=false --bridge=none \
    >/var/log/embedserve-ci-dockerd.log 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    if docker_answers; then
      log "Docker engine: $(docker version -f '{{.Server.Version}}'), storage driver $(docker info -f '{{.Driver}}')"
      return
    fi
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 1
  done
  tail -n 20 /var/log/embedserve-ci-dockerd.log >&2 || true
  DOCKERD_PID=
  fail "dockerd did not start: no Docker engine, so the container checks cannot run"
}

port_free() {
  python3 -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "$1" 2>/dev/null
}

health() { docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$1"; }

wait_healthy() {  # wait_healthy CONTAINER TIMEOUT_S
  local deadline=$((SECONDS + $2)) status
  while ((SECONDS < deadline)); do
    status=$(health "$1")
    [[ $(docker inspect -f '{{.State.Running}}' "$1") == true ]] || fail "$1 exited: $(docker logs --tail 20 "$1" 2>&1)"
    if [[ $status == healthy ]]; then
      log "$1: healthy after $((SECONDS - STEP_START)) s"
      return
    fi
    sleep 1
  done
  docker inspect -f '{{json .State.Health}}' "$1" >&2
  fail "$1 not healthy within $2 s (status: $status)"
}

step "Docker engine"
ensure_docker
# Every build leaves the images it replaced, untagged (two to four GB a run): a machine that runs
# this often fills its disk. Those of the last two hours stay as the next build's layer cache.
log "untagged images removed: $(docker image prune -f --filter until=2h | tail -n 1)"

step "build images"
deploy/docker/build-images.sh

step "start containers, wait for healthy"
remove_containers
for port in "$ENGINE_PORT" "$GATEWAY_PORT"; do
  port_free "$port" || fail "127.0.0.1:$port is taken (set EMBEDSERVE_CI_ENGINE_PORT / EMBEDSERVE_CI_GATEWAY_PORT)"
done
docker volume create "$STATS" >/dev/null
docker volume create "$HISTORY" >/dev/null
docker run -d --name "$ENGINE" --network host \
  --security-opt no-new-privileges:true --stop-timeout 60 \
  -e EMBEDSERVE_ENGINE__HOST=127.0.0.1 \
  -e EMBEDSERVE_ENGINE__PORT="$ENGINE_PORT" \
  -e EMBEDSERVE_ENGINE__CPU_THREADS=2 \
  -v "$STATS":/run/embedserve/stats \
  "$REGISTRY/engine-cpu:$TAG" >/dev/null
wait_healthy "$ENGINE" 180
docker run -d --name "$GATEWAY" --network host --pid "container:$ENGINE" \
  --read-only --tmpfs /tmp --security-opt no-new-privileges:true --stop-timeout 45 \
  -e EMBEDSERVE_ENGINE__URLS="[\"http://127.0.0.1:$ENGINE_PORT\"]" \
  -e EMBEDSERVE_GATEWAY__HOST=127.0.0.1 \
  -e EMBEDSERVE_GATEWAY__PORT="$GATEWAY_PORT" \
  -e EMBEDSERVE_HEALTH__PERSIST_PATH=/var/lib/embedserve/health-history.json \
  -v "$STATS":/run/embedserve/stats \
  -v "$HISTORY":/var/lib/embedserve \
  "$REGISTRY/gateway:$TAG" >/dev/null
wait_healthy "$GATEWAY" 120

export EMBEDSERVE_E2E_URL=http://127.0.0.1:$GATEWAY_PORT
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -m external_stack)

step "end-to-end tests against the gateway"
"${PYTEST[@]}" tests/test_e2e_openai.py tests/test_bad_input.py tests/test_clients.py

step "read-only root filesystem"
if docker exec "$GATEWAY" sh -c 'echo x > /written-here' 2>/dev/null; then
  fail "the gateway's root filesystem is writable"
fi
if docker logs "$GATEWAY" 2>&1 | grep -iE 'read-only file system|EROFS|permission denied'; then
  fail "the gateway tried to write where it cannot (lines above)"
fi
log "root filesystem read-only; nothing in the gateway's log tried to write outside tmpfs and volumes"

step "docker stop drains"
EMBEDSERVE_E2E_CONTAINERS="$GATEWAY $ENGINE" "${PYTEST[@]}" -s tests/test_container_stop.py
docker run --rm --network none -v "$HISTORY":/v --entrypoint python "$REGISTRY/gateway:$TAG" \
  -c 'import json; json.load(open("/v/health-history.json"))' \
  || fail "the gateway wrote no health history to its volume on stop"
log "health history written to its volume on stop"

step ""
log "timings (total $((SECONDS - T0)) s):"
printf '  %s\n' "${TIMES[@]}"
