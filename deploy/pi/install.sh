#!/usr/bin/env bash
# seedfed as a device on a 64-bit Raspberry Pi OS (Debian 12, aarch64) or any arm64 Debian:
#   sudo bash deploy/pi/install.sh [--user pi] [--prefix /opt/seedfed] [--torch torch==2.13.0]
# run from a checkout of this repository on the Pi. Installs the device only (seedfed[torch]:
# no server, no Flower; add `--fleet` for a Flower SuperNode), a systemd unit
# (seedfed-device.service, not enabled until /etc/seedfed/device.env is filled in) and
# /etc/seedfed/device.env.example. deploy/arm-check.sh runs these same pip steps in an arm64
# root under emulation and checks the bits against x86.
set -euo pipefail
USER_NAME=pi PREFIX=/opt/seedfed TORCH=torch==2.13.0 EXTRA="[torch]"
# PyPI's aarch64 torch 2.13 is a CUDA build (2.9 GB of nvidia-* wheels, measured by
# arm-check): take the CPU build from PyTorch's index instead (--torch-index to change it).
TORCH_INDEX=https://download.pytorch.org/whl/cpu
while [ $# -gt 0 ]; do
  case $1 in
    --user) USER_NAME=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --torch) TORCH=$2; shift 2 ;;
    --torch-index) TORCH_INDEX=$2; shift 2 ;;
    --fleet) EXTRA="[torch,fleet]"; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
SRC=$(cd "$(dirname "$0")/../.." && pwd)
[ "$(id -u)" = 0 ] || { echo "run with sudo" >&2; exit 2; }
[ "$(uname -m)" = aarch64 ] || echo "warning: $(uname -m), not aarch64 (32-bit Pi OS is not supported)" >&2
id "$USER_NAME" >/dev/null 2>&1 || { echo "no user $USER_NAME (--user NAME)" >&2; exit 2; }

# gcc builds the stream kernel (shared/model/_zkernel.c); without it the numpy path gives the same bits
apt-get install -y --no-install-recommends python3 python3-venv ca-certificates gcc libc6-dev
python3 -m venv "$PREFIX"
# Replay does not depend on the torch release or build (z is defined by integers).
"$PREFIX/bin/pip" install --upgrade pip
"$PREFIX/bin/pip" install "$TORCH" --index-url "$TORCH_INDEX"
"$PREFIX/bin/pip" install "$SRC$EXTRA"
# The check every port makes first: the perturbation stream's golden vectors.
"$PREFIX/bin/seedfed" protocol vectors > /dev/null

install -d -m 0755 /etc/seedfed
install -d -o "$USER_NAME" -m 0700 /var/lib/seedfed-device
install -m 0644 "$SRC/deploy/pi/device.env.example" /etc/seedfed/device.env.example
sed -e "s|^User=.*|User=$USER_NAME|" -e "s|/opt/seedfed|$PREFIX|g" \
  "$SRC/deploy/pi/seedfed-device.service" > /etc/systemd/system/seedfed-device.service
systemctl daemon-reload 2>/dev/null || true
cat <<MSG
Installed into $PREFIX. Next:
  sudo cp /etc/seedfed/device.env.example /etc/seedfed/device.env   # set URL, task, token, paths
  sudo chmod 600 /etc/seedfed/device.env
  sudo systemctl enable --now seedfed-device
  journalctl -u seedfed-device -f
MSG
