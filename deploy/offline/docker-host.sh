#!/usr/bin/env bash
# What a Debian bookworm machine needs to build the images and run compose.yaml, installed when
# missing (root): Debian's docker.io (dockerd, containerd, runc) and mmdebstrap; the compose v2 and
# buildx CLI plugins from Debian trixie's docker-compose / docker-buildx packages (bookworm's compose is
# v1, which rejects compose.yaml's env_file entries with path/required; the plugins need only libc6 >=
# 2.34). Starts no daemon. The compose test tier (tests/compose) runs it first.
#   deploy/offline/docker-host.sh
set -euo pipefail
plugins=/usr/local/lib/docker/cli-plugins

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker >/dev/null || need+=(docker.io)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ ${#need[@]} -gt 0 ]; then
  echo "docker host: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

compose_v2() { docker compose version 2>/dev/null | grep -Eq 'version v?2\.'; }
if ! compose_v2 || ! docker buildx version >/dev/null 2>&1; then
  echo "docker host: compose v2 and buildx plugins from Debian trixie"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/lists/partial"
  echo "deb http://deb.debian.org/debian trixie main" >"$work/sources.list"
  apt_trixie=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$work/lists" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
  apt-get -qq "${apt_trixie[@]}" update
  (cd "$work" && apt-get -qq "${apt_trixie[@]}" download docker-compose docker-buildx 2>/dev/null)
  for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
  mkdir -p "$plugins"
  install -m 0755 "$work/root/usr/libexec/docker/cli-plugins/docker-compose" "$plugins/docker-compose"
  install -m 0755 "$work/root/usr/libexec/docker/cli-plugins/docker-buildx" "$plugins/docker-buildx"
  compose_v2 || { echo "docker host: compose v2 did not install" >&2; exit 1; }
fi
