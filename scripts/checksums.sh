#!/usr/bin/env bash
# Final checksums of fixed `seedfed simulate` runs and of the protocol vectors: the bits a
# refactor must not change. Run it on the tree before and after a change and compare the files.
#
#   bash scripts/checksums.sh PATH/sst2/train.tsv OUT.txt [SEEDFED]
#
# One line per run: its name and the final model version's checksum (report.json).
set -euo pipefail
DATA=$1; OUT=$2; S=${3:-seedfed}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
export OMP_NUM_THREADS=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
: > "$OUT"
run() {
  local name=$1; shift
  "$S" simulate "$@" --out "$T/$name" > "$T/$name.log" 2>&1 || { cat "$T/$name.log"; exit 1; }
  python3 -c "import json, sys; print(sys.argv[1], json.load(open(sys.argv[2]))['final_checksum'])" \
    "$name" "$T/$name/report.json" >> "$OUT"
}
run tastes --engine inprocess --rounds 3
run tastes_flower --engine flower --rounds 2
run int8 --engine inprocess --rounds 2 --format int8
run lora --engine inprocess --rounds 2 --scope lora
run sst2 --engine inprocess --rounds 2 --devices 4 --data "$DATA"
echo "vectors $("$S" protocol vectors --all | sha256sum | cut -c1-16)" >> "$OUT"
cat "$OUT"
