#!/usr/bin/env bash
# make arm-check: the device side on aarch64 (a Raspberry Pi's or a phone's CPU), under
# qemu-user emulation. In a debootstrapped Debian 12 arm64 root, install the device
# (seedfed[torch]) and aarch64 torch from PyPI, then check the bits against this x86 host:
# the golden vectors (`seedfed protocol vectors`) and the replay of a log recorded here
# (deploy/replay_check.py: the checksum after every entry). Needs root. Everything lives under
# one temporary directory, unmounted and removed on exit, pass or fail.
# Writes the result as JSON to $ARM_CHECK_JSON (default: runs/arm-check.json).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# shellcheck source=deploy/lib/common.sh
. "$ROOT/deploy/lib/common.sh"
PY=${PY:-$ROOT/.venv/bin/python}
OUT_JSON=${ARM_CHECK_JSON:-$ROOT/runs/arm-check.json}
TORCH_ARM=${TORCH_ARM:-torch==2.13.0}
start=$(date +%s)

[ "$(id -u)" = 0 ] || { log "arm-check needs root (debootstrap, chroot)"; exit 2; }
need_packages debootstrap qemu-user-static binfmt-support
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
  mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64

W=$(mktemp -d /var/tmp/seedfed-arm.XXXXXX)
R="$W/root"
cleanup() {
  local rc=$?
  set +e
  unmount_under "$W"
  rm -rf "$W"
  log "arm-check exit $rc after $(( $(date +%s) - start )) s"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# On the host: the model, the recorded log and the reference vectors.
mkdir -p "$W/ref"
"$PY" -c "from pathlib import Path; from tests.fleet_helpers import make_tiny_bert; \
make_tiny_bert(Path('$W/ref/model'))" >/dev/null 2>&1
"$PY" "$ROOT/deploy/replay_check.py" record --model "$W/ref/model" --out "$W/ref/log.json" \
  > "$W/ref/record.json" 2>/dev/null
"$ROOT/.venv/bin/seedfed" protocol vectors > "$W/ref/vectors.json"
log "x86 reference: $(cat "$W/ref/record.json")"

t0=$(date +%s)
# No ca-certificates package: its configure step (one openssl per CA under emulation) is the
# slowest part of the root, and the host's bundle replaces it anyway. gcc builds the stream
# kernel (shared/model/_zkernel.c), as install.sh does on a Pi.
# ARM_ROOT_CACHE=FILE.tar (optional, for reruns by hand): reuse a root saved by an earlier run.
if [ -n "${ARM_ROOT_CACHE:-}" ] && [ -s "$ARM_ROOT_CACHE" ]; then
  mkdir -p "$R" && tar -C "$R" -xf "$ARM_ROOT_CACHE"
else
  debootstrap_root "$R" arm64 python3,python3-venv,gcc,libc6-dev
  unmount_under "$R"
  [ -z "${ARM_ROOT_CACHE:-}" ] || tar -C "$R" -cf "$ARM_ROOT_CACHE" .
fi
t_root=$(( $(date +%s) - t0 ))
log "arm64 root in ${t_root} s"
# The host's CA bundle (it trusts the TLS-intercepting proxy between here and PyPI), DNS.
mkdir -p "$R/etc/ssl/certs"
cp /etc/ssl/certs/ca-certificates.crt "$R/etc/ssl/certs/ca-certificates.crt"
cp -L /etc/resolv.conf "$R/etc/resolv.conf"
mountpoint -q "$R/proc" || mount -t proc proc "$R/proc"
mkdir -p "$R/src" "$R/ref"
cp -r "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/README.md" "$ROOT/seedfed" \
  "$ROOT/shared" "$ROOT/client" "$ROOT/server" "$R/src/"
cp -r "$W/ref/model" "$W/ref/log.json" "$ROOT/deploy/replay_check.py" "$R/ref/"
find "$R/src" -name __pycache__ -prune -exec rm -rf {} +

in_root() {
  chroot "$R" /usr/bin/env -i PATH=/opt/seedfed/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DEFAULT_TIMEOUT=180 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 TRANSFORMERS_VERBOSITY=error "$@"
}
t0=$(date +%s)
in_root python3 -m venv /opt/seedfed
# The Pi recipe (deploy/pi/install.sh): PyPI's aarch64 torch is a CPU build, then the
# device (the torch extra: no server, no Flower).
in_root pip install -q "$TORCH_ARM" > "$W/pip.log" 2>&1 || { tail -30 "$W/pip.log" >&2; exit 1; }
in_root pip install -q '/src[torch]' >> "$W/pip.log" 2>&1 || { tail -30 "$W/pip.log" >&2; exit 1; }
t_install=$(( $(date +%s) - t0 ))
log "device install in ${t_install} s"

t0=$(date +%s)
machine=$(in_root python -c 'import platform; print(platform.machine())')
torch_version=$(in_root python -c 'import torch; print(torch.__version__)' 2>/dev/null)
in_root seedfed protocol vectors > "$W/arm-vectors.json"
t_vectors=$(( $(date +%s) - t0 ))
t0=$(date +%s)
set +e
in_root python /ref/replay_check.py verify --model /ref/model --record /ref/log.json \
  > "$W/arm-replay.json" 2>"$W/arm-replay.err"
replay_rc=$?
set -e
t_replay=$(( $(date +%s) - t0 ))
[ $replay_rc = 0 ] || tail -20 "$W/arm-replay.err" >&2

mkdir -p "$(dirname "$OUT_JSON")"
"$PY" - "$W" "$machine" "$torch_version" "$t_root" "$t_install" "$t_vectors" "$t_replay" \
  "$OUT_JSON" <<'PYEOF'
import json, sys
from pathlib import Path
w, machine, torch_version = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
t_root, t_install, t_vectors, t_replay = map(int, sys.argv[4:8])
ref_vectors = (w / "ref/vectors.json").read_text()
arm_vectors = (w / "arm-vectors.json").read_text()
ref = json.loads((w / "ref/record.json").read_text())
arm = json.loads((w / "arm-replay.json").read_text() or "{}")
result = {
    "machine": machine, "torch": torch_version,
    "vectors_equal": ref_vectors == arm_vectors and bool(arm_vectors.strip()),
    "x86_replay_checksum": ref["checksum"], "arm_replay_checksum": arm.get("checksum"),
    "replay_equal": arm.get("checksum") == ref["checksum"] and bool(arm.get("matches_record")),
    "entries": ref["entries"], "error": arm.get("error"),
    "stream": {"x86": ref.get("stream"), "arm": arm.get("stream")},
    "seconds": {"arm64_root": t_root, "device_install": t_install, "vectors": t_vectors,
                "replay": t_replay},
}
Path(sys.argv[8]).write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
ok = machine == "aarch64" and result["vectors_equal"] and result["replay_equal"]
sys.exit(0 if ok else 1)
PYEOF
