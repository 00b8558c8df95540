"""What a round costs as the fleet grows: `seedfed simulate` with 100, 1,000 and 10,000 devices,
100 of them a round, on the SST-2 recipe's task.

Each fleet runs as its own `seedfed simulate` process (the command a user types), so its peak
memory is its own: the process's peak RSS (`wait4`), and the peak of the summed RSS of its
whole process tree sampled every 0.2 s (the Simulation Engine's Ray processes included). The
wall per round is the median of the report's round times after the first (the first also
starts the engine and loads the model). Before the fleets run, the feature cache is filled
with the training split once (`seedfed.features.prefill`; a no-op where an earlier run on this
machine left it), so that no fleet pays the one-off encoding of 64k sentences and the comparison is
of the rounds alone. Target: the cost per round depends on the devices per round, not on the
fleet size: round wall at 10,000 devices within 1.5 x of 100.

    seedfed bench fleet_size --data PATH/sst2/train.tsv \
        --json benchmarks/results/fleet_size.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from seedfed.bench.registry import bench_parser
from seedfed.bench.report import write_json
from seedfed.features import AUTO, store_root

FLEETS = (100, 1_000, 10_000)
TARGET = 1.5


def warm_cache(data: str, cache: Path, workers: int) -> float:
    """Encode the data's training split into `cache` (a no-op when it holds it); seconds."""
    from seedfed.client.device_data import dataset_splits
    from seedfed.features import SharedFeatures, prefill
    from seedfed.shared.protocol.recipes import resolve_recipe

    started = time.perf_counter()
    prefill(SharedFeatures(cache), resolve_recipe("sst2").spec,
            dataset_splits(data).train.texts, workers)
    return time.perf_counter() - started


def _tree_rss(root: int) -> int:
    import psutil

    try:
        procs = [psutil.Process(root)] + psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def run_fleet(args: argparse.Namespace, devices: int, engine: str, cache: Path,
              out: Path) -> dict[str, Any]:
    """One `seedfed simulate` of `devices` devices, timed and sampled."""
    command = [str(Path(sys.executable).with_name("seedfed")), "simulate", "--data", args.data,
               "--devices", str(devices), "--set", f"devices_per_round={args.per_round}",
               "--rounds", str(args.rounds), "--engine", engine, "--set",
               f"feature_cache={cache}",
               "--seed", str(args.seed), "--out", str(out)]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = proc.stderr.read() if proc.stderr is not None else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    rounds = [r["seconds"] for r in report["rounds"]]
    return {"devices": devices, "engine": engine, "wall_s": round(wall, 1),
            "round_s": [round(s, 2) for s in rounds],
            "round_s_median_after_first": round(statistics.median(rounds[1:]), 2),
            "device_compute_s": round(report["device_compute_s"], 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024),  # the simulate process
            "peak_tree_rss_mib": round(peak[0] / 2**20),  # with every process it started
            "final_version": report["final_version"],
            "devices_reported": len(report["devices"]),
            # as a reader reruns it: the data and the run directory named, not this machine's
            "command": " ".join(["seedfed", *command[1:]]).replace(args.data, "PATH/sst2/train.tsv")
            .replace(f" --set feature_cache={cache}", "").replace(f" --out {out}", "")}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("fleet_size")
    parser.add_argument("--data", required=True, help="SST-2 train.tsv (label<TAB>sentence)")
    parser.add_argument("--fleets", type=int, nargs="+", default=list(FLEETS))
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--engines", nargs="+", default=["inprocess", "flower"],
                        choices=["inprocess", "flower"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=None, help="feature cache directory "
                        "(default: the user's, as `seedfed simulate` uses it), filled first")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix="fleet-size-") as tmp:
        cache = args.cache or store_root(AUTO, Path(tmp))
        warm_s = warm_cache(args.data, cache, os.cpu_count() or 2)
        print(f"feature cache filled in {warm_s:.0f} s", flush=True)
        rows = []
        for engine in args.engines:
            for devices in args.fleets:
                row = run_fleet(args, devices, engine, cache, Path(tmp) / f"{engine}-{devices}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for engine in args.engines:
        by = {r["devices"]: r for r in rows if r["engine"] == engine}
        small, large = by.get(min(args.fleets)), by.get(max(args.fleets))
        if small and large:
            ratio = large["round_s_median_after_first"] / small["round_s_median_after_first"]
            summary[engine] = {"round_ratio_largest_to_smallest": round(ratio, 2),
                               "met": ratio <= TARGET}
    result = {"benchmark": "fleet_size", "data": Path(args.data).name,
              "per_round": args.per_round, "rounds": args.rounds, "target_ratio": TARGET,
              "cpus": os.cpu_count(), "feature_cache_fill_s": round(warm_s, 1),
              "runs": rows, "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.json:
        write_json(args.json, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
