#!/usr/bin/env bash
# Makes sure a Docker engine answers: uses the running one, else installs Debian's docker.io and
# docker-compose (apt, as root) and starts dockerd in the background (no systemd needed; defaults:
# overlay2, bridge network). Exit 0 when `docker info` answers; exit 3 with one line
# "docker unavailable: <reason>" on stderr when no engine can be had here (not root, no apt, dockerd
# refuses to start: e.g. no privileges in an unprivileged container).
set -uo pipefail
LOG=${DOCKERD_LOG:-/var/log/tokenmill-dockerd.log}
unavailable() { echo "docker unavailable: $*" >&2; exit 3; }

if docker info >/dev/null 2>&1; then
  command -v docker-compose >/dev/null || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; }
  exit 0
fi
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null; then
  [ "$(id -u)" = 0 ] || unavailable "no running engine, and installing docker.io needs root"
  command -v apt-get >/dev/null || unavailable "no running engine, and no apt-get to install docker.io"
  apt-get update -qq >/dev/null 2>&1 || unavailable "apt-get update failed (no Debian mirror reachable?)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose >/dev/null 2>&1 \
    || unavailable "apt-get install docker.io docker-compose failed"
fi
[ "$(id -u)" = 0 ] || unavailable "dockerd is installed but not running, and starting it needs root"
echo "dockerd.sh: starting dockerd (log: $LOG)" >&2
nohup dockerd >"$LOG" 2>&1 &
pid=$!
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && exit 0
  kill -0 "$pid" 2>/dev/null || unavailable "dockerd exited at start: $(grep -m1 -iE 'failed|error' "$LOG" || tail -1 "$LOG")"
  sleep 1
done
unavailable "dockerd did not answer within 60 s (log: $LOG)"
