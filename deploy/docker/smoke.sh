#!/usr/bin/env bash
# make docker-smoke: the images built and run as an operator would, on a machine that reaches no image
# registry, with no network inside any build (docs/DEPLOY.md, "What CI checks"):
#
#   1. a Docker engine (deploy/docker/dockerd.sh: Debian's docker.io, dockerd started if none runs)
#   2. a local Debian base with the Dockerfile's OS packages (deploy/docker/base.sh: debootstrap, once per machine)
#   3. the wheelhouse, filled by the host's pip (deploy/docker/wheelhouse.sh)
#   4. the CPU image, `docker build --network none --build-arg VARIANT=cpu --build-arg OFFLINE=1`
#   5. `docker run -p ...:8000 tokenmill:cpu`: /health, /generate SSE, the README's chat question ("Paris"),
#      the C++ kernels in use, the healthcheck turns healthy, `docker stop` during a stream: the stream
#      ends, exit 0 within the drain timeout; between those, the router image (deploy/router/Dockerfile,
#      same base, same wheelhouse) run in front of that container: its readiness, a chat through it
#   6. the GPU variant's runtime stage built on the local base (torch's CPU build, triton from the wheelhouse):
#      as its user, a C compiler, Python.h, a writable Triton cache, Triton builds and compiles (gpu_runtime_check.py)
#   7. the compose stack's tokenmill service up on the CPU image (no build: the image is built once), the
#      kernels of step 5 found on its cache volume, a chat through it
#
# Exit 0: all passed; 3: no Docker engine can be had here (the reason is printed); else a failure.
# Images stay (tokenmill:cpu, tokenmill:gpu-check, tokenmill-router:0.1.17, the base), so a second run reuses every layer.
set -euo pipefail
cd "$(dirname "$0")/../.."
# Debian's client (dockerd.sh installs it) builds with BuildKit without the buildx plugin; a newer
# client in front of it on PATH may need buildx for that.
export DOCKER=${DOCKER:-$(command -v /usr/bin/docker || echo docker)}
# the repository's compose file alone, with an empty env file: an operator's .env (COMPOSE_FILE,
# TOKENMILL_MODEL) stays out
no_env=$(mktemp)
COMPOSE="${COMPOSE:-docker-compose} --env-file $no_env -f docker-compose.yml"
CPU_IMAGE_TAG=${CPU_IMAGE_TAG:-tokenmill:cpu}
CHECK_IMAGE_TAG=${CHECK_IMAGE_TAG:-tokenmill:gpu-check}
ROUTER_IMAGE_TAG=${ROUTER_IMAGE_TAG:-tokenmill-router:0.1.17}
NAME=tokenmill-smoke-$$
ROUTER_NAME=tokenmill-smoke-router-$$
PROJECT=tokenmill-smoke-$$
DRAIN_S=$(sed -n 's/^drain_timeout_s: *\([0-9]*\).*/\1/p' configs/cpu.yaml)
HTTP="python3 deploy/docker/smoke_http.py"
started=$SECONDS
declare -a timings=()

step() {
  [ -n "${step_name:-}" ] && timings+=("$(printf '%4d s  %s' $((SECONDS - step_t0)) "$step_name")")
  step_name=$1 step_t0=$SECONDS
  printf '\n== docker-smoke: %s (at %d s)\n' "$1" $((SECONDS - started))
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
cleanup() {
  $DOCKER rm -f "$NAME" "$ROUTER_NAME" >/dev/null 2>&1 || true
  COMPOSE_PROJECT_NAME=$PROJECT $COMPOSE down -v --remove-orphans >/dev/null 2>&1 || true
  rm -f "$no_env"
}
trap cleanup EXIT
logs_and_fail() {
  echo "docker-smoke: FAILED: $1" >&2
  [ -n "${2:-}" ] && $DOCKER logs --tail 60 "$2" >&2 2>&1
  exit 1
}

step "docker engine"
deploy/docker/dockerd.sh || exit $?
$DOCKER version --format 'client {{.Client.Version}}, engine {{.Server.Version}}'

step "local base image (debootstrap, no registry)"
BASE=$(deploy/docker/base.sh)

# BuildKit when the client has it (COPY --from is 5x faster on these machines than the legacy builder's)
if printf 'FROM %s\n' "$BASE" | DOCKER_BUILDKIT=1 $DOCKER build -q --network none - >/dev/null 2>&1; then
  export DOCKER_BUILDKIT=1 BUILDKIT_PROGRESS=plain
  echo "builder: BuildKit"
else
  export DOCKER_BUILDKIT=0
  echo "builder: legacy (no BuildKit in this client)"
fi

step "wheelhouse (host pip)"
py=$($DOCKER run --rm --network none "$BASE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
deploy/docker/wheelhouse.sh "$py"

build() {  # build TAG ARGS...: no network inside, only the base and the wheelhouse
  local tag=$1 log; shift
  log=$(mktemp)
  # BASE_IMAGE: the router's Dockerfile; CPU_IMAGE, CUDA_IMAGE: the main one (each ignores the others)
  if ! $DOCKER build --network none --build-arg CPU_IMAGE="$BASE" --build-arg CUDA_IMAGE="$BASE" \
      --build-arg BASE_IMAGE="$BASE" --build-arg OFFLINE=1 "$@" -t "$tag" . >"$log" 2>&1; then
    tail -40 "$log" >&2
    logs_and_fail "docker build of $tag"
  fi
  printf 'build steps from cache: %s\n' "$(grep -c -e 'Using cache' -e ' CACHED$' "$log" || true)"
  rm -f "$log"
  $DOCKER image inspect -f "built $tag: {{.Size}} bytes" "$tag"
}

step "CPU image (docker build --network none, VARIANT=cpu, OFFLINE=1)"
build "$CPU_IMAGE_TAG" --build-arg VARIANT=cpu

step "docker run $CPU_IMAGE_TAG"
port=$(free_port)
$DOCKER run -d --name "$NAME" -p "127.0.0.1:$port:8000" "$CPU_IMAGE_TAG" >/dev/null
url=http://127.0.0.1:$port
$HTTP health "$url" --timeout 300 || logs_and_fail "/health" "$NAME"
$HTTP generate "$url" || logs_and_fail "/generate" "$NAME"
$HTTP chat "$url" || logs_and_fail "chat" "$NAME"
logs=$($DOCKER logs "$NAME" 2>&1)
grep -q "attention=cpu" <<<"$logs" || logs_and_fail "the engine is not on the C++ CPU kernels (attention=cpu)" "$NAME"
grep -E "opened|building the CPU kernels|engine ready" <<<"$logs" | cut -c1-160  # where the start-up went
for _ in $(seq 40); do  # the HEALTHCHECK runs every 15 s
  health=$($DOCKER inspect -f '{{.State.Health.Status}}' "$NAME")
  [ "$health" = healthy ] && break
  sleep 1
done
[ "$health" = healthy ] || logs_and_fail "the healthcheck says $health" "$NAME"
echo "healthcheck: $health"

step "router image (deploy/router/Dockerfile, OFFLINE=1) in front of the container"
build "$ROUTER_IMAGE_TAG" -f deploy/router/Dockerfile
# on the default bridge (no DNS there), by the tokenmill container's address; the compose profile's policy
worker=http://$($DOCKER inspect -f '{{.NetworkSettings.IPAddress}}' "$NAME"):8000
router_port=$(free_port)
$DOCKER run -d --name "$ROUTER_NAME" -p "127.0.0.1:$router_port:8080" "$ROUTER_IMAGE_TAG" \
  --worker-urls "$worker" --policy cache_aware --health-check-endpoint /health >/dev/null
router_url=http://127.0.0.1:$router_port
$HTTP health "$router_url" --path /readiness --timeout 60 || logs_and_fail "the router's /readiness" "$ROUTER_NAME"
$HTTP chat "$router_url" || logs_and_fail "chat through the router" "$ROUTER_NAME"
$DOCKER rm -f "$ROUTER_NAME" >/dev/null

step "docker stop during a stream (drain_timeout_s $DRAIN_S)"
stream_log=$(mktemp)
$HTTP stream "$url" --max-tokens 32 >"$stream_log" 2>&1 &
stream_pid=$!
for _ in $(seq 60); do grep -q "first token" "$stream_log" && break; sleep 0.5; done
t0=$SECONDS
$DOCKER stop -t $((DRAIN_S + 15)) "$NAME" >/dev/null
stop_s=$((SECONDS - t0))
wait "$stream_pid" || { cat "$stream_log"; logs_and_fail "the stream in flight at SIGTERM did not finish" "$NAME"; }
cat "$stream_log"
code=$($DOCKER inspect -f '{{.State.ExitCode}}' "$NAME")
echo "docker stop: ${stop_s} s, exit code $code"
[ "$code" = 0 ] || logs_and_fail "exit code $code after docker stop" "$NAME"
[ "$stop_s" -le "$DRAIN_S" ] || logs_and_fail "docker stop took ${stop_s} s, over drain_timeout_s $DRAIN_S" "$NAME"

step "GPU runtime stage on the local base (VARIANT=gpu; torch's CPU build, triton 3.7.1)"
build "$CHECK_IMAGE_TAG" --build-arg VARIANT=gpu
$DOCKER run --rm -i --network none --entrypoint python3 "$CHECK_IMAGE_TAG" - <deploy/docker/gpu_runtime_check.py \
  || logs_and_fail "the GPU runtime stage check"

step "docker compose up tokenmill (CPU, the image built above)"
# The CPU kernels the docker run step built, into the stack's cache volume: the service must find them
# there (XDG_CACHE_HOME=/cache) instead of building them again.
volume=${PROJECT}_model-cache
$DOCKER volume create --label com.docker.compose.project="$PROJECT" --label com.docker.compose.volume=model-cache \
  "$volume" >/dev/null
$DOCKER cp "$NAME:/cache/tokenmill" - \
  | $DOCKER run --rm -i --network none -v "$volume:/cache" --entrypoint tar "$CPU_IMAGE_TAG" -x -C /cache
$DOCKER rm "$NAME" >/dev/null
port=$(free_port)
export COMPOSE_PROJECT_NAME=$PROJECT TOKENMILL_HOST_PORT=$port TOKENMILL_IMAGE=$CPU_IMAGE_TAG
$COMPOSE up -d --no-build tokenmill
container=$($COMPOSE ps -q tokenmill)
$HTTP health "http://127.0.0.1:$port" --timeout 300 || logs_and_fail "/health through compose" "$container"
$HTTP chat "http://127.0.0.1:$port" || logs_and_fail "chat through compose" "$container"
logs=$($DOCKER logs "$container" 2>&1)
grep -q "attention=cpu" <<<"$logs" || logs_and_fail "the engine is not on the C++ CPU kernels" "$container"
! grep "building the CPU kernels" <<<"$logs" || logs_and_fail "the kernels were built again: not found on the cache volume" "$container"
$COMPOSE down -v --remove-orphans
unset COMPOSE_PROJECT_NAME TOKENMILL_HOST_PORT TOKENMILL_IMAGE

step "done"
printf '%s\n' "${timings[@]}"
total=$((SECONDS - started))
echo "docker-smoke: passed in $total s"
[ "$total" -le 720 ] || echo "docker-smoke: WARNING: over the 12-minute budget ($total s)"
