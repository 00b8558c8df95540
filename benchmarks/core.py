"""Core benchmarks: ZO memory vs inference/SGD/AdamW, ZO step vs forward, replay.

    python benchmarks/core.py [--quick] [--json PATH] [--repeats N] [--threads N] [--strict]

is the same as `seedfed bench core ...`. The measuring code lives in `seedfed.bench.core` (an
installed module, so the console script and the per-measurement worker processes find it
from any install); this script is the repository's entry point to it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from seedfed.bench.core import main


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small Llama, under a minute")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    missed = main(quick=args.quick, json_path=args.json, repeats=args.repeats,
                  threads=args.threads)
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(cli())
