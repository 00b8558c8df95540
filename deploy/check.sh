#!/usr/bin/env bash
# make deploy-check: build the coordinator and PostgreSQL images from scratch, bring up
# deploy/compose.yaml (coordinator + PostgreSQL + TLS SuperLink with SuperNode auth), run two
# rounds with two SuperNode containers, restart the coordinator, then tear everything down.
# Needs root (dockerd, debootstrap). Everything lives under one temporary directory, removed
# on exit with the dockerd it started, pass or fail. KEEP=1 keeps the directory (not dockerd).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# shellcheck source=deploy/lib/common.sh
. "$ROOT/deploy/lib/common.sh"
PY=${PY:-$ROOT/.venv/bin/python}
BASE=seedfed-ci-bookworm
start=$(date +%s)

[ "$(id -u)" = 0 ] || { log "deploy-check needs root (dockerd, debootstrap)"; exit 2; }
need_packages docker.io docker-compose debootstrap
W=$(mktemp -d /var/tmp/seedfed-deploy.XXXXXX)
cleanup() {
  local rc=$?
  set +e
  stop_dockerd "$W"
  if [ "${KEEP:-0}" = 1 ]; then log "kept $W"; else rm -rf "$W"; fi
  log "deploy-check exit $rc after $(( $(date +%s) - start )) s"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_dockerd "$W"

# A base image made here: no registry is reachable from CI.
debootstrap_root "$W/rootfs" amd64
tar -C "$W/rootfs" -c . | docker import - "$BASE" >/dev/null
rm -rf "$W/rootfs"
log "base image $BASE imported"

# The build context: the package sources plus build-extra (the local CPU torch wheel, the
# host's CA bundle for the TLS-intercepting proxy between the build and PyPI).
ctx="$W/context"
mkdir -p "$ctx/deploy"
cp -r "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/README.md" "$ROOT/seedfed" \
  "$ROOT/shared" "$ROOT/client" "$ROOT/server" "$ctx/"
cp -r "$ROOT/deploy/Dockerfile" "$ROOT/deploy/build-extra" "$ctx/deploy/"
find "$ctx" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$ctx"/deploy/build-extra/*.whl
"$PY" -m pip download -q torch==2.13.0 --no-deps -d "$ctx/deploy/build-extra"
cp /etc/ssl/certs/ca-certificates.crt "$ctx/deploy/build-extra/ca.crt"

log "building seedfed-coordinator"
nice -n 19 docker build -q --network=host --build-arg BASE_IMAGE="$BASE" \
  -f "$ctx/deploy/Dockerfile" -t seedfed-coordinator "$ctx" >"$W/build-coordinator.log" 2>&1 \
  || { tail -40 "$W/build-coordinator.log" >&2; exit 1; }
log "building seedfed-postgres"
nice -n 19 docker build -q --network=host --build-arg BASE_IMAGE="$BASE" \
  -t seedfed-postgres "$ROOT/deploy/postgres" >"$W/build-postgres.log" 2>&1 \
  || { tail -40 "$W/build-postgres.log" >&2; exit 1; }
docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep seedfed >&2
log "images built after $(( $(date +%s) - start )) s"

SEEDFED_DEPLOY_CHECK=1 SEEDFED_IMAGE=seedfed-coordinator SEEDFED_POSTGRES_IMAGE=seedfed-postgres \
  SEEDFED_DEPLOY_WORK="$W/stack" \
  "$PY" -m pytest "$ROOT/tests/deploy/test_compose_stack.py" -q -p no:cacheprovider \
  -o addopts="" -rA --timeout 1200
