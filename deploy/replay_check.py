"""Does this machine replay a recorded log to the same bits? (deploy/arm-check.sh, devices)

    python deploy/replay_check.py record --model DIR --out log.json [--entries 12 --seeds 8]
    python deploy/replay_check.py verify --model DIR --record log.json

`record` (on the reference machine) builds the task's model from DIR, saves its version-0
trainable state, and writes a log of update entries (seeds and float32 coefficients drawn
from a fixed generator) with the state checksum after each entry, computed here. `verify`
(on the device) loads that version 0, replays the log through the same code a device uses
(`replay` with per-entry checksum checks: any differing bit fails) and prints the final
checksum as JSON. Exit status 1 on a mismatch. Nothing here depends on the device's float
unit beyond IEEE float32 addition: z is defined by integers (docs/protocol.md).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def _spec(model: Path, scope: str) -> Any:
    from seedfed.shared.protocol.task import TaskSpec

    return TaskSpec(model_path=str(model), label_texts=("bad", "good"), scope=scope,
                    max_seq_len=16)


def record(model: Path, out: Path, entries: int, seeds: int, scope: str) -> dict[str, Any]:
    from seedfed.client.sync import state_bytes
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.model.replay import apply_seeds, checksum
    from seedfed.shared.protocol.npzo import LogEntry

    spec = _spec(model, scope)
    bundle = build_model(spec, initialize=True)
    v0 = state_bytes(bundle.scope)
    rng = np.random.default_rng(20260101)
    log = []
    for v in range(entries):
        # seeds over the whole 64-bit range, coefficients of realistic size, as float32
        s = [int(x) for x in rng.integers(0, 2**63, size=seeds, dtype=np.int64)]
        c = [float(np.float32(x)) for x in rng.normal(0.0, 1e-3, size=seeds)]
        e = LogEntry("replay-check", v, tuple(s), tuple(c))
        apply_seeds(bundle.scope, e.seeds, e.coefs)
        log.append({"base_version": v, "seeds": s, "coefs": c,
                    "checksum": checksum(bundle.scope)})
    data = {"spec": spec.to_dict(), "v0": base64.b64encode(v0).decode(), "entries": log,
            "checksum": log[-1]["checksum"] if log else checksum(bundle.scope)}
    out.write_text(json.dumps(data))
    return {"entries": entries, "checksum": data["checksum"], "stream": _stream_path()}


def verify(model: Path, recorded: Path) -> dict[str, Any]:
    from seedfed.client.sync import load_state
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.model.replay import checksum, replay
    from seedfed.shared.protocol.npzo import LogEntry
    from seedfed.shared.protocol.task import TaskSpec

    data = json.loads(recorded.read_text())
    spec = TaskSpec.from_dict({**data["spec"], "model_path": str(model)})
    bundle = build_model(spec, initialize=False)
    v0 = load_state(bundle.scope, base64.b64decode(data["v0"]))
    entries = [LogEntry("replay-check", e["base_version"], tuple(e["seeds"]),
                        tuple(e["coefs"]), e["checksum"]) for e in data["entries"]]
    # raises ChecksumMismatchError at the first entry whose state differs by any bit
    version = replay(bundle.scope, entries, task_id="replay-check", version=0)
    final = checksum(bundle.scope)
    return {"v0": v0, "version": version, "checksum": final,
            "matches_record": final == data["checksum"], "stream": _stream_path()}


def _stream_path() -> str:
    """Which implementation of the stream ran: the C kernel or the numpy reference."""
    try:
        from seedfed.shared.model import zkernel
    except ImportError:  # a revision without the kernel
        return "numpy"
    return "kernel" if zkernel.KERNEL is not None else "numpy"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", type=Path, required=True)
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--entries", type=int, default=12)
    rec.add_argument("--seeds", type=int, default=8)
    rec.add_argument("--scope", default="lora")
    ver = sub.add_parser("verify")
    ver.add_argument("--model", type=Path, required=True)
    ver.add_argument("--record", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "record":
        result = record(args.model, args.out, args.entries, args.seeds, args.scope)
    else:
        try:
            result = verify(args.model, args.record)
        except Exception as e:  # a mismatch or a broken install: report it, exit 1
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
            return 1
    print(json.dumps(result))
    return 0 if result.get("matches_record", True) else 1


if __name__ == "__main__":
    sys.exit(main())
