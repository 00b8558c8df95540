"""The ORT device beside the torch device: ms per scalar, peak RSS, install size.

    seedfed bench ort_device --data PATH/TO/sst2/train.tsv [--rounds 6] [--devices 20]

The SST-2 recipe (`seedfed.shared.protocol.recipes`, `sst2`: pretrained MiniLM, head scope) is
exported to an ORT bundle once; then each backend runs in its own fresh process (one thread: torch
`set_num_threads(1)`, ONNX Runtime `intra_op_num_threads=1`) as device 0 of the recipe's fleet:
load v0, run `--rounds` round plans of the recipe on its own examples, and report

- ms per scalar: a round's train time / (steps x P), the median over the warm rounds (round 1
  also encodes the device's sentences: reported apart, `first_round_ms`);
- peak RSS of the process (ru_maxrss, everything loaded);
- install size: the files (RECORD) of the dependency closure of `seedfed[torch]` and of
  `seedfed[device-ort]` (pyproject.toml), as installed in this venv.

Both devices upload the same scalars (checked here: max |difference|). Writes
benchmarks/results/ort_device.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from seedfed.bench.registry import RESULTS, bench_parser
from seedfed.bench.report import write_json

#: The source checkout this module runs from (an editable install): its pyproject.toml lists
#: the extras whose install sizes are measured, and `--venvs` pip-installs it.
CHECKOUT = Path(__file__).resolve().parents[2]
PYPROJECT = CHECKOUT / "pyproject.toml"
#: The extra each backend installs (`pip install seedfed[EXTRA]`).
EXTRAS = {"torch": "torch", "ort": "device-ort"}


def _requirements(extra: str) -> list[str]:
    """Names of what `pip install seedfed[extra]` pulls directly: the base dependencies and
    the extra's (self-references like seedfed[torch] expanded), read from pyproject.toml."""
    import tomllib

    from packaging.requirements import Requirement

    if not PYPROJECT.is_file():
        raise SystemExit(f"error: {PYPROJECT} not found; run this benchmark from a source "
                         "checkout installed with `pip install -e .`")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project["optional-dependencies"]
    names: list[str] = []
    todo = list(project["dependencies"]) + list(extras[extra])
    while todo:
        req = Requirement(todo.pop())
        if req.name == "seedfed":
            todo += [r for e in req.extras for r in extras[e]]
        else:
            names.append(req.name)
    return names


def _closure(roots: list[str]) -> set[str]:
    """Installed distributions reachable from `roots` (environment markers evaluated,
    optional extras not followed)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _size_mb(names: set[str]) -> float:
    total = 0
    for name in names:
        dist = metadata.distribution(name)
        for f in dist.files or []:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                total += path.stat().st_size
    return total / 2**20


def install_sizes() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend, extra in EXTRAS.items():
        names = _closure(_requirements(extra))
        out[backend] = {"mb": round(_size_mb(names), 1), "distributions": len(names),
                        "has_torch": "torch" in names}
    out["ratio"] = round(out["torch"]["mb"] / out["ort"]["mb"], 2)
    return out


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux keeps that across execve, so a
    worker started from the exporting parent would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def clean_venv_sizes() -> dict[str, Any]:
    """`du` of a fresh venv with `pip install '.[EXTRA]'` of each backend (minutes: pip
    resolves from the configured indexes; without a pinned CPU wheel it takes torch's
    default build, which on x86 Linux is the CUDA one with its nvidia-* libraries)."""
    out: dict[str, Any] = {}
    for backend, extra in {"empty": None, **EXTRAS}.items():
        with tempfile.TemporaryDirectory(prefix="seedfed-venv-") as tmp:
            venv = Path(tmp) / "venv"
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            if extra is not None:
                subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"{CHECKOUT}[{extra}]"],
                               check=True, capture_output=True)
            size = int(subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True,
                                      check=True).stdout.split()[0])
            listed = subprocess.run([str(venv / "bin" / "pip"), "list"], capture_output=True,
                                    text=True).stdout.lower().split()
            out[backend] = {"mb": size, "has_torch": "torch" in listed}
    out["ratio"] = round((out["torch"]["mb"] - out["empty"]["mb"])
                         / (out["ort"]["mb"] - out["empty"]["mb"]), 1)
    return out


def worker(args: argparse.Namespace) -> None:
    """One backend in this process: v0, `rounds` plans, timings, RSS, the scalars."""
    import numpy as np

    from seedfed.client.device_data import DeviceData, load_device_examples
    from seedfed.shared.protocol.task import TaskSpec
    from seedfed.shared.protocol.wire import RoundPlan

    spec = TaskSpec.from_dict(json.loads(Path(args.spec).read_text()))
    snap = Path(args.snapshot).read_bytes()
    chk = Path(args.snapshot + ".sha256").read_text().strip()
    data = DeviceData(source=args.data, partition_id=0, num_partitions=args.devices)
    train, _ = load_device_examples(data)
    t0 = time.perf_counter()
    from seedfed.client.backends.base import BackendConfig
    from seedfed.client.device import Device

    if args.worker == "torch":
        import torch

        torch.set_num_threads(1)
    bundle = args.bundle if args.worker == "ort" else None  # torch: the task's model_path
    dev = Device(spec, "bench", backend=BackendConfig(kind=args.worker, model=bundle,
                                                      threads=1))
    dev.load_snapshot(snap, 0, chk)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    times, scalars = [], []
    hyper = spec.hyper
    for r in range(1, args.rounds + 1):
        seeds = rng.integers(0, 2**53, size=(hyper.steps, hyper.perturbations)).tolist()
        plan = RoundPlan(task_id="bench", round=r, version=0, seeds=seeds, lr=hyper.lr,
                         eps=hyper.eps, batch_size=hyper.batch_size, scope=spec.scope)
        t = time.perf_counter()
        out = dev.train(plan, train, data)
        times.append(time.perf_counter() - t)
        scalars.append(out.scalars.tolist())
    per = hyper.steps * hyper.perturbations
    print(json.dumps({
        "backend": args.worker, "load_s": round(load_s, 2),
        "first_round_ms": round(1e3 * times[0], 1),
        "ms_per_scalar": round(1e3 * statistics.median(times[1:]) / per, 4),
        "ms_per_scalar_all": [round(1e3 * t / per, 4) for t in times],
        "peak_rss_mb": _peak_rss_mb(),
        "torch_loaded": "torch" in sys.modules, "examples": len(train), "scalars": scalars}))


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("ort_device")
    ap.add_argument("--data", required=True, help="labelled TSV (SST-2 train.tsv)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--devices", type=int, default=20, help="fleet size (device 0's share)")
    ap.add_argument("--bundle", default=None, help="reuse an exported bundle directory")
    ap.add_argument("--out", default=str(RESULTS / "ort_device.json"))
    ap.add_argument("--venvs", action="store_true", help="also measure fresh venvs per extra")
    ap.add_argument("--worker", choices=("torch", "ort"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--snapshot", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    from seedfed.client.backends.ort.export import export_bundle
    from seedfed.client.sync import state_bytes
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.model.replay import checksum
    from seedfed.shared.protocol.recipes import resolve_recipe

    torch.set_num_threads(1)
    spec = resolve_recipe("sst2").spec
    tmp = Path(tempfile.mkdtemp(prefix="seedfed-ort-bench-"))
    bundle = Path(args.bundle) if args.bundle else tmp / "bundle"
    export_s = None
    if not (bundle / "manifest.json").is_file():
        t = time.perf_counter()
        export_bundle(spec, bundle)
        export_s = round(time.perf_counter() - t, 1)
    v0 = build_model(spec, initialize=True)
    (tmp / "spec.json").write_text(json.dumps(spec.to_dict()))
    (tmp / "v0.safetensors").write_bytes(state_bytes(v0.scope))
    (tmp / "v0.safetensors.sha256").write_text(checksum(v0.scope))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    runs = {}
    for backend in ("torch", "ort"):
        cmd = [sys.executable, "-m", "seedfed.bench.ort_device", "--worker", backend,
               "--data", args.data, "--rounds", str(args.rounds), "--devices", str(args.devices),
               "--bundle", str(bundle), "--spec", str(tmp / "spec.json"),
               "--snapshot", str(tmp / "v0.safetensors")]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        runs[backend] = json.loads(done.stdout.strip().splitlines()[-1])
    import numpy as np

    diff = float(np.abs(np.array(runs["torch"].pop("scalars"), dtype=np.float32)
                        - np.array(runs["ort"].pop("scalars"), dtype=np.float32)).max())
    bundle_mb = sum(f.stat().st_size for f in bundle.iterdir()) / 2**20
    result = {
        "task": (f"SST-2 recipe: MiniLM-L6 head scope, P={spec.hyper.perturbations}, "
                 f"{spec.hyper.steps} step x {spec.hyper.batch_size} examples, step scales "
                 f"{list(spec.step_scales)}, 1 thread"),
        "rounds": args.rounds, "export_s": export_s, "bundle_mb": round(bundle_mb, 1),
        "max_abs_scalar_diff": diff, "torch": runs["torch"], "ort": runs["ort"],
        "speedup_ms_per_scalar": round(runs["torch"]["ms_per_scalar"]
                                       / runs["ort"]["ms_per_scalar"], 2),
        "rss_ratio": round(runs["torch"]["peak_rss_mb"] / runs["ort"]["peak_rss_mb"], 2),
        "install": install_sizes(),
    }
    if args.venvs:
        result["clean_venvs"] = clean_venv_sizes()
    write_json(Path(args.out), result, indent=1)
    print(f"{'':8}{'ms/scalar':>10}{'1st round ms':>14}{'peak RSS MB':>13}{'install MB':>12}")
    for b in ("torch", "ort"):
        r = runs[b]
        print(f"{b:8}{r['ms_per_scalar']:>10}{r['first_round_ms']:>14}{r['peak_rss_mb']:>13}"
              f"{result['install'][b]['mb']:>12}")
    print(f"max |scalar difference| {diff:.2e}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
