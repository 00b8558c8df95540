# Shared by deploy/check.sh and deploy/arm-check.sh (sourced, not run): packages, a private
# dockerd, a debootstrapped Debian root, and cleanup of everything they started.
# Host networking only: dockerd runs without iptables, bridge or forwarding, so the host's
# firewall and routes are untouched and containers talk on 127.0.0.1 only.

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# need_packages PKG...: apt-get install what is missing (CI machines start bare).
need_packages() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
      || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
  fi
}

# The Debian mirror apt uses here (debootstrap fetches from it too).
debian_mirror() {
  local uri
  uri=$(grep -hs -m1 -E '^URIs: .*/debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '{print $2}' || true)
  [ -n "$uri" ] || uri=$(grep -hs -m1 -E '^deb .*/debian/? ' /etc/apt/sources.list \
                         2>/dev/null | awk '{print $2}' || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# start_dockerd DIR: a dockerd of our own (data root, exec root, socket under DIR); sets
# DOCKERD_PID and DOCKER_HOST, and puts Debian's docker CLI first on PATH.
start_dockerd() {
  local dir=$1
  mkdir -p "$dir/docker-data" "$dir/docker-exec" "$dir/bin"
  ln -sf /usr/bin/docker "$dir/bin/docker"
  export PATH="$dir/bin:$PATH" DOCKER_HOST="unix://$dir/docker.sock" DOCKER_BUILDKIT=0
  dockerd --data-root "$dir/docker-data" --exec-root "$dir/docker-exec" \
    --pidfile "$dir/dockerd.pid" -H "$DOCKER_HOST" --storage-driver overlay2 \
    --iptables=false --ip6tables=false --bridge=none --ip-forward=false --ip-masq=false \
    >"$dir/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && { log "dockerd $DOCKERD_PID up ($dir)"; return 0; }
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 1
  done
  tail -20 "$dir/dockerd.log" >&2
  log "dockerd did not start"
  return 1
}

# stop_dockerd DIR: remove containers, stop our dockerd by its PID (then its containerd), and
# unmount whatever is still mounted under DIR.
stop_dockerd() {
  local dir=$1 cpid=""
  if [ -n "${DOCKERD_PID:-}" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
    docker ps -aq 2>/dev/null | xargs -r docker rm -f >/dev/null 2>&1 || true
    cpid=$(cat "$dir/docker-exec/containerd/containerd.pid" 2>/dev/null || true)
    kill -TERM "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$DOCKERD_PID" 2>/dev/null || true
    wait "$DOCKERD_PID" 2>/dev/null || true
    if [ -n "$cpid" ] && kill -0 "$cpid" 2>/dev/null; then
      kill -TERM "$cpid" 2>/dev/null || true
      sleep 2
      kill -KILL "$cpid" 2>/dev/null || true
    fi
    log "dockerd $DOCKERD_PID stopped"
  fi
  unmount_under "$dir"
}

# unmount_under DIR: every mount point below DIR, deepest first.
unmount_under() {
  local dir
  dir=$(readlink -f "$1")
  # (grep finding nothing is the usual case: it must not fail the caller under set -e)
  { findmnt -rn -o TARGET 2>/dev/null | grep -F "$dir/" || true; } | sort -r \
    | while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
      done
}

# debootstrap_root ROOT ARCH [INCLUDE]: a minimal Debian 12 root.
debootstrap_root() {
  local root=$1 arch=$2 include=${3:-}
  log "debootstrap $arch bookworm into $root"
  nice -n 19 debootstrap --variant=minbase --arch="$arch" ${include:+--include="$include"} \
    bookworm "$root" "$(debian_mirror)" >"$root.log" 2>&1 \
    || { tail -30 "$root.log" >&2; return 1; }
}
