#!/usr/bin/env bash
# Debian's chromium for the dashboard's browser tests (playwright's own browser download cannot
# run on machines without internet). Skips the install when chromium is already there.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
