"""Personalization benchmark: the shipped personal part beside personalized-FL baselines.

Every method is `seedfed simulate` on the in-process engine (`simulate.driver.run`): the real
coordinator, strategy, ClientApp and device core, on the same task, seeds, fleet and ZO budget.
Only the device's personal part differs (`SimulationConfig.personal`):

- global:   the shared model alone (every run reports it; identical across runs, since the
            personal part never reaches an upload).
- local:    a head trained on the device's own data alone, from the task's prototype head,
            with the personal part's ZO budget (each personalized run trains it as reference).
- residual: shared head + a personal residual head (the shipped default, client/personal.py).
- ditto:    a personal copy of the head regularized towards the current shared head.
- fedper:   a personal copy of the head, trained freely (FedPer/FedRep: shared body,
            personal head).

Tasks: the per-device taste task (`tastes`, the default demo) and, with --sst2, a label-skewed
SST-2 split (device i's majority class is 90% of its examples).

    seedfed bench personalization --sst2 PATH/sst2/train.tsv \\
        --out benchmarks/results/personalization.json

Also measures a device's peak memory (VmHWM of a fresh process) scoring its held-out set with
the shared model (inference) and doing a personal round plus the personalized scoring.
Writes JSON (--out), a PNG beside it, and prints a markdown table (docs/personalization.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from seedfed.bench.registry import RESULTS, bench_parser
from seedfed.bench.report import write_json
from seedfed.shared.protocol import recipes
from seedfed.simulate.config import SimulationConfig
from seedfed.simulate.driver import run

METHODS: tuple[str, ...] = ("off", "residual", "ditto", "fedper")


def task_configs(args: argparse.Namespace, root: Path) -> dict[str, dict[str, Any]]:
    # the taste task's recipe fleet (recipe `tastes`: 20 devices, all every round)
    tasks: dict[str, dict[str, Any]] = {
        "tastes": {"data": "tastes", "devices": args.taste_devices, "rounds": args.rounds}}
    if args.sst2:
        tasks["sst2-skew"] = {"data": args.sst2, "devices": 10, "rounds": args.rounds,
                              "label_skew": 0.9, "pool": args.pool}
    return tasks


def one_run(task: dict[str, Any], method: str, out: Path, seed: int = 0) -> dict[str, Any]:
    config = SimulationConfig(out=out, engine="inprocess", personal=method, eval_every=10,
                              seed=seed, **task)
    started = time.perf_counter()
    report = run(config).to_dict()
    return {"method": method, "wall_s": time.perf_counter() - started,
            "personalization": report["personalization"], "devices": report["devices"],
            "shared_test_accuracy": report["rounds"][-1]["accuracy"],
            "upload_bytes": [r["upload_bytes"] for r in report["rounds"]],
            "final_checksum": report["final_checksum"]}


_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np, torch
    torch.set_num_threads(1)
    from seedfed.client.device import Device
    from seedfed.client.device_data import DeviceData, load_device_examples
    from seedfed.shared.protocol import recipes
    from seedfed.client.personal import PersonalConfig

    def status(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    mode = sys.argv[1]
    spec = recipes.resolve_recipe("tastes").spec  # the tastes task's
    data = DeviceData(source="tastes", partition_id=0, num_partitions=20)
    train, held = load_device_examples(data)
    device = Device(spec, "bench", personal=PersonalConfig() if mode == "personal" else None)
    device.evaluate(held)  # (the shared head as built: which values it holds costs nothing)
    if mode == "personal":
        device.personal.train(train, np.random.default_rng(0))
        device.evaluate_personal(held)
    print(json.dumps({"peak": status("VmHWM")}))
""")


def device_memory() -> dict[str, Any]:
    """Peak RSS of a device process of the tastes task: building the model and scoring its
    held-out set with the shared model (inference) vs the same plus a personal part, one
    personal round and the personalized scoring."""
    peaks = {}
    for mode in ("inference", "personal"):
        out = subprocess.run([sys.executable, "-c", _CHILD, mode],
                             capture_output=True, text=True, timeout=600, check=True)
        peaks[mode] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    return {"inference_peak_bytes": peaks["inference"],
            "personal_peak_bytes": peaks["personal"],
            "ratio": peaks["personal"] / peaks["inference"]}


def table(results: dict[str, Any]) -> str:
    lines = ["| task | method | mean acc | worst decile | devices >= shared | "
             "shared test acc | upload B/round | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for task, runs in results["tasks"].items():
        ref = next(r for r in runs if r["method"] == "residual")["personalization"]
        if ref is None:  # no device reported (a failed run): nothing to tabulate
            continue
        rows = [("global (shared only)", ref["shared_accuracy_mean"],
                 ref["shared_accuracy_worst_decile"], None, runs[0]),
                ("local only", ref["local_accuracy_mean"], ref["local_accuracy_worst_decile"],
                 None, None)]
        for r in runs:
            if r["method"] == "off":
                continue
            p = r["personalization"]
            rows.append((r["method"], p["personal_accuracy_mean"],
                         p["personal_accuracy_worst_decile"],
                         p["share_personal_at_least_shared"], r))
        for name, mean, worst, share, r in rows:
            extra = ("-", "-", "-") if r is None else (
                f"{r['shared_test_accuracy']:.3f}",
                f"{sum(r['upload_bytes']) / len(r['upload_bytes']):,.0f}", f"{r['wall_s']:.0f}")
            lines.append(f"| {task} | {name} | {mean:.3f} | {worst:.3f} | "
                         f"{'-' if share is None else f'{share:.0%}'} | " + " | ".join(extra)
                         + " |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t, runs in results["tasks"].items()
             if next(r for r in runs if r["method"] == "residual")["personalization"]]
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        runs = results["tasks"][task]
        ref = next(r for r in runs if r["method"] == "residual")["personalization"]
        names = ["global", "local"] + [r["method"] for r in runs if r["method"] != "off"]
        means = [ref["shared_accuracy_mean"], ref["local_accuracy_mean"]] + [
            r["personalization"]["personal_accuracy_mean"] for r in runs if r["method"] != "off"]
        worst = [ref["shared_accuracy_worst_decile"], ref["local_accuracy_worst_decile"]] + [
            r["personalization"]["personal_accuracy_worst_decile"] for r in runs
            if r["method"] != "off"]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], means, 0.4, label="mean over devices")
        ax.bar([x + 0.2 for x in xs], worst, 0.4, label="worst decile")
        ax.set_xticks(list(xs), names)
        ax.set_ylim(0, 1)
        ax.set_ylabel("device held-out accuracy")
        ax.set_title(f"{task}: shared vs personalized")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("personalization")
    ap.add_argument("--sst2", help="SST-2 train.tsv: adds the label-skewed SST-2 task")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--taste-devices", type=int, default=recipes.TASTES_DEVICES,
                    help="devices of the taste task (default: its recipe's)")
    ap.add_argument("--seed", type=int, default=0, help="the taste generator's and split's seed "
                    "(tune on seeds other than 0; report seed 0)")
    ap.add_argument("--pool", type=int, default=2000, help="SST-2 examples the fleet shares")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", type=Path, default=RESULTS / "personalization.json")
    ap.add_argument("--tasks", default="tastes,sst2-skew", help="tasks to run (sst2-skew needs "
                    "--sst2); with an existing --out, the other tasks' results are kept")
    ap.add_argument("--memory", action="store_true", help="only (re)measure device memory into "
                    "an existing --out")
    ap.add_argument("--render", action="store_true", help="only redraw the plot and table of "
                    "an existing --out")
    args = ap.parse_args(argv)
    results: dict[str, Any]
    if args.render or args.memory:
        results = json.loads(args.out.read_text())
        if args.memory:
            results["memory"] = device_memory()
            write_json(args.out, results, newline=False)
        render(results, args.out)
        return 0
    methods = [m for m in args.methods.split(",") if m]
    if "residual" not in methods:
        raise SystemExit("--methods must include residual (the table's reference)")
    results = {"tasks": {}, "rounds": args.rounds, "seed": args.seed}
    if args.out.is_file():  # keep what an earlier run measured for the tasks not run now
        earlier = json.loads(args.out.read_text())
        if (earlier.get("rounds"), earlier.get("seed", 0)) == (args.rounds, args.seed):
            results = earlier
    results["seed"] = args.seed
    wanted = set(args.tasks.split(","))
    with tempfile.TemporaryDirectory(prefix="seedfed-personal-") as tmp:
        root = Path(tmp)
        for task, cfg in task_configs(args, root).items():
            if task not in wanted:
                continue
            results["tasks"][task] = []
            for method in methods:
                out = root / f"{task}-{method}"
                results["tasks"][task].append(one_run(cfg, method, out, args.seed))
                print(f"{task} {method}: {results['tasks'][task][-1]['personalization']}",
                      flush=True)
            if task == "tastes":
                results["memory"] = device_memory()
    write_json(args.out, results, newline=False)
    render(results, args.out)
    return 0


def render(results: dict[str, Any], out: Path) -> None:
    """The plot beside `out`, the table and the checks against the run without a personal
    part (each run's task has its own secret, so the shared models are equal in
    distribution, not bit for bit; the scalars of one plan are bit-identical,
    tests/client/test_personal_device.py)."""
    plot(results, out.with_suffix(".png"))
    print(table(results))
    for task, runs in results["tasks"].items():
        off = next((r for r in runs if r["method"] == "off"), None)
        if off is None:
            continue
        for r in runs:
            print(f"{task} {r['method']}: shared test accuracy {r['shared_test_accuracy']:.4f} "
                  f"({r['shared_test_accuracy'] - off['shared_test_accuracy']:+.4f} vs off); "
                  f"upload bytes per round equal to off: "
                  f"{r['upload_bytes'] == off['upload_bytes']}")
    if "memory" in results:
        m = results["memory"]
        print(f"device peak RSS: inference {m['inference_peak_bytes'] / 2**20:.0f} MiB, "
              f"personal round + scoring {m['personal_peak_bytes'] / 2**20:.0f} MiB "
              f"(x{m['ratio']:.3f})")


if __name__ == "__main__":
    sys.exit(main())
