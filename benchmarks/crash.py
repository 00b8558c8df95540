"""Crash and fault campaign: SIGKILL a real coordinator under uploads, restart it,
check that no accepted upload was lost or duplicated, no version committed twice, versions
contiguous, checksums equal to replay from v0.

    python benchmarks/crash.py --db sqlite postgres --kills 100 \
        --json benchmarks/results/crash.json

is the same as `seedfed bench crash ...`. The code lives in `seedfed.bench.crash` (installed,
so the console script finds it); this script is the repository's entry point to it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from seedfed.bench.crash import main


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", nargs="+", default=["sqlite", "postgres"],
                    choices=["sqlite", "postgres"])
    ap.add_argument("--kills", type=int, default=100, help="SIGKILLs per backend")
    ap.add_argument("--devices", type=int, default=48)
    ap.add_argument("--quorum", type=int, default=8, help="uploads that close a round")
    ap.add_argument("--threads", type=int, default=12, help="load-generating threads")
    ap.add_argument("--seeds", type=int, default=16, help="scalars per upload")
    ap.add_argument("--at-close", type=float, default=0.5,
                    help="share of kills aimed right after a round reached its quorum")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop killing after this many seconds per backend (then verify)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/crash.json"))
    args = ap.parse_args(argv)
    rows = main(backends=args.db, kills=args.kills, devices=args.devices, quorum=args.quorum,
                lanes=args.threads, seeds=args.seeds, at_close=args.at_close,
                json_path=args.json, seed=args.seed, budget_s=args.budget_s)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(cli())
