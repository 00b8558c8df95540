"""Federated TerMeZO on a ternary classifier: which latents to train, at one forward budget.

Every run goes through the real round code: `simulate.driver.run` on the in-process grid (the
coordinator, the ServerApp strategy, the ClientApp devices holding the packed ternary model,
replay checked by checksum), the task a ternary seq_cls task on `--model` (a `seedfed
ternarize` base, or the fp32 MiniLM ternarized as the task converts it). Variants, same rounds,
devices, steps and perturbations, so the same number of forwards per device:

- `threshold`: the TerMeZO mask (latents nearest gamma / 2), prototype head frozen;
- `random`: as many latents drawn uniformly;
- `full`: every latent (full-latent MeZO: the device holds every latent);
- `head`: no latent, the float head alone (selection 'none' + train_head, head-sized lr,
  the head's P and the SST-2 head recipe's bias step scale);
- `threshold+head`, `random+head`: alternate mask epochs (`TernaryOptions.alternate`): even
  epochs the float head alone (head lr, head P), odd epochs that mask's latents alone.

Per run: held-out accuracy of version 0 (the ternary base, zero-shot) and of the last version;
with `--tune`, the threshold mask's fraction, epoch length and lr are first chosen on the
validation split (seed 0) and the winners used for every variant's test runs. Device memory:
in a subprocess per variant, the packed model from the published snapshot of v0, VmHWM reset
after loading, then one no-grad forward (inference) and one ZO step (the plan's P probes); the
device's bytes of mask + latents come from the scope.

    seedfed bench ternary_fed --data PATH/sst2/train.tsv --model runs/ternary-minilm \\
        --json benchmarks/results/ternary_fed_sst2.json
    seedfed bench ternary_fed --data builtin --model runs/ternary-minilm ...
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seedfed.bench.registry import bench_parser
from seedfed.bench.report import write_json

#: Scope options every variant sets (over the ternary recipe's), so a variant is only itself.
PLAIN: dict[str, Any] = {"train_head": False, "alternate": False, "head_lr": None,
                         "head_perturbations": None, "head_steps": None}
#: variant -> scope option overrides
VARIANTS: dict[str, dict[str, Any]] = {
    "threshold": {**PLAIN, "selection": "threshold"},
    "random": {**PLAIN, "selection": "random"},
    "full": {**PLAIN, "selection": "full"},
    "head": {**PLAIN, "selection": "none", "train_head": True},
    "threshold+head": {**PLAIN, "selection": "threshold", "train_head": True, "alternate": True},
    "random+head": {**PLAIN, "selection": "random", "train_head": True, "alternate": True},
}


@dataclass(frozen=True)
class Budget:
    """The fleet and settings of every variant. The fleet and the head's settings are the
    ternary recipe's (`seedfed simulate --recipe ternary`): the `head` variant at
    batch size 32 is what `seedfed simulate --format ternary` runs. The latent variants'
    lr and seeds are the TerMeZO alternate-epoch settings chosen on validation (threshold mask
    5%, lr 3.3e-4, 4 seeds a step); batch 8 by default, the batch of docs/ternary.md's
    latent and alternate-epoch results."""

    rounds: int = 40
    devices: int = 10
    per_round: int = 10
    perturbations: int = 4
    batch_size: int = 8
    eval_size: int = 1000
    lr: float = 3.3e-4  # latent variants (and the alternate variants' latent epochs)
    head_lr: float = 32.0  # the head's start lr (the SST-2 head recipe's)
    head_perturbations: int = 512  # seeds per step when the head alone trains
    head_steps: int | None = None  # alternate variants: local steps in head epochs
    eps: float = 1e-3
    fraction: float = 0.05
    epoch_rounds: int = 5
    alpha: float = 0.5


@dataclass
class Run:
    variant: str
    seed: int
    split: str
    initial: float | None
    final: float | None
    seconds: float
    options: dict[str, Any] = field(default_factory=dict)
    #: seconds the devices' calls took in all (train + sync, every device, every round)
    device_seconds: float | None = None


def one_run(data: str, model: str, variant: str, seed: int, b: Budget, out: Path,
            validation: bool = False, **overrides: Any) -> Run:
    from seedfed.simulate.config import SimulationConfig
    from seedfed.simulate.driver import run

    options, hyper = variant_settings(variant, b, **overrides)
    cfg = SimulationConfig(out=out, devices=b.devices, rounds=b.rounds,
                           model=model, data=data, alpha=b.alpha, seed=seed,
                           devices_per_round=b.per_round,
                           eval_size=b.eval_size, engine="inprocess", eval_every=b.rounds,
                           eval_on_validation=validation, format="ternary",
                           personal="off", overrides=task_overrides(b, options, hyper))
    started = time.perf_counter()
    report = run(cfg)
    final = report.rounds[-1].accuracy if report.rounds else None
    return Run(variant, seed, "validation" if validation else "test", report.initial_accuracy,
               final, time.perf_counter() - started, {**options, **hyper},
               sum(r.device_compute_s or 0.0 for r in report.rounds))


def task_overrides(b: Budget, options: dict[str, Any], hyper: dict[str, Any]
                   ) -> tuple[tuple[str, Any], ...]:
    """The ternary recipe's overrides of a run (`SimulationConfig.overrides`): one step of
    the budget's eps and batch, the variant's scope options, lr, seeds and step scales."""
    return (("hyper.steps", 1), ("hyper.eps", b.eps), ("hyper.batch_size", b.batch_size),
            ("hyper.lr", hyper["lr"]), ("hyper.perturbations", hyper["perturbations"]),
            ("spec.step_scales", hyper["step_scales"]),
            *((f"scope_options.{k}", v) for k, v in options.items()))


def variant_settings(variant: str, b: Budget, **overrides: Any,
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(scope options, SimulationConfig lr / perturbations / step_scales) of a variant; a
    trained head takes the SST-2 head recipe's conditioning (its bias step scale)."""
    from seedfed.shared.protocol.recipes import HEAD_STEP_SCALES

    options = {**VARIANTS[variant], "fraction": overrides.get("fraction", b.fraction),
               "epoch_rounds": overrides.get("epoch_rounds", b.epoch_rounds)}
    lr = overrides.get("lr", b.lr)
    if variant == "head":
        return options, {"lr": b.head_lr, "perturbations": b.head_perturbations,
                         "step_scales": HEAD_STEP_SCALES}
    if options.get("alternate"):
        options.update(head_lr=b.head_lr, head_perturbations=b.head_perturbations,
                       head_steps=b.head_steps)
        return options, {"lr": lr, "perturbations": b.perturbations,
                         "step_scales": HEAD_STEP_SCALES}
    return options, {"lr": lr, "perturbations": b.perturbations, "step_scales": ()}


def tune(data: str, model: str, b: Budget, work: Path) -> tuple[dict[str, Any], list[Run]]:
    """The threshold mask's fraction, epoch length and lr with the best validation accuracy."""
    grid = [{"fraction": f, "epoch_rounds": e, "lr": lr}
            for f in (0.01, 0.05) for e in (b.epoch_rounds,) for lr in (b.lr / 3, b.lr, b.lr * 3)]
    runs = [one_run(data, model, "threshold", 0, b, work / f"tune{i}", validation=True, **g)
            for i, g in enumerate(grid)]
    best = max(range(len(grid)), key=lambda i: runs[i].final or 0.0)
    return grid[best], runs


MEMORY_SCRIPT = r"""
import json, sys, resource
from pathlib import Path
import torch
torch.set_num_threads(1)
from seedfed.shared.protocol.task import TaskSpec
from seedfed.client.ternary import PackedTernary
from seedfed.client.data import tokenize
from seedfed.shared.protocol.wire import RoundPlan
from seedfed.shared.model.ternary import bitlinear_modules

def vm(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
a = json.loads(sys.argv[1])
spec = TaskSpec.from_dict(a["spec"])
dev = PackedTernary(spec)
dev.load_snapshot(Path(a["snapshot"]).read_bytes(), 0, a["checksum"])
from seedfed.client.device_data import DeviceData, load_device_examples
ex = load_device_examples(DeviceData(source=a["data"]))[0]
ex = ex.subset(range(min(spec.hyper.batch_size, len(ex))))
batch = tokenize(dev.tokenizer, ex.texts, ex.labels, spec.max_seq_len)
loaded = vm("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
with torch.no_grad():
    dev.model(**{k: v for k, v in batch.items() if k != "labels"})
infer = vm("VmHWM")
Path("/proc/self/clear_refs").write_text("5")
lr, steps, p = spec.round_hyper(1, 0)  # alternate epochs: v0 is a head epoch (head P)
seeds = [list(range(1 + s * p, 1 + (s + 1) * p)) for s in range(steps)]
plan = RoundPlan(task_id="m", round=1, version=0, seeds=seeds,
                 lr=lr, eps=spec.hyper.eps, batch_size=spec.hyper.batch_size,
                 scope="ternary", mask_epoch=0)
dev.trainer.run(plan, iter([batch] * steps))
zo = vm("VmHWM")
parts = dev.scope.device_bytes()
print(json.dumps({"loaded_mib": loaded, "infer_peak_mib": infer, "zo_peak_mib": zo,
                  "zo_over_infer": zo / infer, "device_bytes": parts,
                  "mask_plus_latent_bytes": parts["mask"] + parts["latent"],
                  "holds_fp32_weights": any(m.weight is not None
                                            for _, m in bitlinear_modules(dev.model))}))
"""


def memory(data: str, model: str, variant: str, b: Budget, work: Path,
           **overrides: Any) -> dict[str, Any]:
    """Device peak memory of packed inference vs one ZO step (own process), and mask bytes,
    with the runs' settings (`overrides`: what `--tune` chose)."""
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings
    from seedfed.simulate.config import SimulationConfig, label_texts, task_spec_for

    options, hyper = variant_settings(variant, b, **overrides)
    cfg = SimulationConfig(out=work, model=model, data=data, format="ternary",
                           personal="off", overrides=task_overrides(b, options, hyper))
    spec = task_spec_for(cfg, label_texts(data, 2))
    work.mkdir(parents=True, exist_ok=True)
    with Coordinator.open(Settings(database_url=f"sqlite:///{work / 'm.db'}",
                                   store_dir=work / "store")) as coord:
        task = coord.create_task(spec)
        snap, chk = coord.snapshot(task, 0, "ternary")
    (work / "v0.safetensors").write_bytes(snap)
    args = json.dumps({"spec": spec.to_dict(), "snapshot": str(work / "v0.safetensors"),
                       "checksum": chk, "data": data})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, args], capture_output=True,
                         text=True, timeout=900, env=env, check=False)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: list[Run], split: str = "test") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in VARIANTS:
        rs = [r for r in runs if r.variant == v and r.split == split]
        if not rs:
            continue
        finals = [r.final for r in rs if r.final is not None]
        inits = [r.initial for r in rs if r.initial is not None]
        out[v] = {"seeds": [r.seed for r in rs], "final": finals,
                  "final_mean": statistics.mean(finals) if finals else None,
                  "final_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                  "initial_mean": statistics.mean(inits) if inits else None,
                  "lift_points": (100 * (statistics.mean(finals) - statistics.mean(inits))
                                  if finals and inits else None),
                  "seconds_mean": statistics.mean(r.seconds for r in rs),
                  "device_seconds_mean": statistics.mean(r.device_seconds or 0.0 for r in rs)}
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"{'variant':15} {'v0 acc':>7} {'final':>7} {'sd':>6} {'lift pt':>8} "
             f"{'zo/infer':>8} {'mask+lat B':>11} {'device s':>9}"]
    for v, s in result["summary"].items():
        mem = result["memory"].get(v, {})
        lines.append(f"{v:15} {s['initial_mean'] or 0:7.4f} {s['final_mean'] or 0:7.4f} "
                     f"{s['final_sd']:6.4f} {s['lift_points'] or 0:8.2f} "
                     f"{mem.get('zo_over_infer', float('nan')):8.3f} "
                     f"{mem.get('mask_plus_latent_bytes', 0):11,} "
                     f"{s.get('device_seconds_mean') or 0:9.0f}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, v in enumerate(names):
        s = result["summary"][v]
        ax.scatter([i] * len(s["final"]), s["final"], color="tab:blue", alpha=0.6)
        ax.errorbar(i, s["final_mean"], yerr=s["final_sd"], fmt="o", color="black", capsize=4)
        ax.hlines(s["initial_mean"], i - 0.3, i + 0.3, color="tab:red", linestyle="--")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(f"held-out accuracy ({result.get('split', 'test')})")
    ax.set_title(f"Federated TerMeZO, {result['data']} (red: version 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("ternary_fed")
    ap.add_argument("--data", required=True, help="SST-2 train.tsv or 'builtin'")
    ap.add_argument("--model", required=True, help="ternary base directory (seedfed ternarize)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=Budget.rounds)
    ap.add_argument("--devices", type=int, default=Budget.devices)
    ap.add_argument("--per-round", type=int, default=Budget.per_round)
    ap.add_argument("--perturbations", type=int, default=Budget.perturbations)
    ap.add_argument("--batch-size", type=int, default=Budget.batch_size)
    ap.add_argument("--eval-size", type=int, default=Budget.eval_size)
    ap.add_argument("--lr", type=float, default=Budget.lr)
    ap.add_argument("--head-lr", type=float, default=Budget.head_lr)
    ap.add_argument("--head-perturbations", type=int, default=Budget.head_perturbations)
    ap.add_argument("--head-steps", type=int, default=None)
    ap.add_argument("--epoch-rounds", type=int, default=Budget.epoch_rounds)
    ap.add_argument("--fraction", type=float, default=Budget.fraction)
    ap.add_argument("--split", choices=("test", "validation"), default="test",
                    help="score the held-out test split, or the validation split (tuning)")
    ap.add_argument("--tune", action="store_true", help="choose fraction and lr on validation")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-only", action="store_true", help="no runs: memory, then --merge")
    ap.add_argument("--merge", type=Path, nargs="*", default=[],
                    help="earlier results JSON files whose runs join this one's summary")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    b = Budget(rounds=a.rounds, devices=a.devices, per_round=a.per_round,
               perturbations=a.perturbations, batch_size=a.batch_size,
               eval_size=a.eval_size, lr=a.lr,
               fraction=a.fraction, head_lr=a.head_lr, head_perturbations=a.head_perturbations,
               epoch_rounds=a.epoch_rounds, head_steps=a.head_steps)
    seeds = [int(s) for s in a.seeds.split(",")]
    variants = [v for v in a.variants.split(",") if v]
    result: dict[str, Any] = {"data": Path(a.data).name if a.data != "builtin" else "builtin",
                              "model": a.model, "budget": b.__dict__, "runs": [],
                              "split": a.split,
                              "memory": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def save() -> None:
        write_json(a.json, result)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        chosen: dict[str, Any] = {}
        if a.tune:
            chosen, tuning = tune(a.data, a.model, b, work)
            result["tuning"] = {"chosen": chosen, "runs": [r.__dict__ for r in tuning]}
            save()
        runs: list[Run] = []
        seen: set[tuple[str, int, str]] = set()
        for path in a.merge:  # runs measured by earlier invocations (e.g. other seeds)
            earlier = json.loads(path.read_text())
            for v, m in earlier.get("memory", {}).items():
                result["memory"].setdefault(v, m)
            for r in earlier["runs"]:
                key = (r["variant"], r["seed"], r["split"])
                if key in seen:  # the first file's run of a (variant, seed) counts
                    continue
                seen.add(key)
                runs.append(Run(**r))
                result["runs"].append(r)
            result.setdefault("merged", []).append(path.name)
        for seed in ([] if a.memory_only else seeds):
            for v in variants:
                r = one_run(a.data, a.model, v, seed, b, work / f"{v}-{seed}",
                            validation=a.split == "validation", **chosen)
                runs.append(r)
                result["runs"].append(r.__dict__)
                result["summary"] = summarize(runs, a.split)
                save()
                print(f"{v} seed {seed}: {r.initial} -> {r.final} ({r.seconds:.0f} s)",
                      flush=True)
        if not a.no_memory:
            for v in variants:
                result["memory"][v] = memory(a.data, a.model, v, b, work / f"mem-{v}", **chosen)
                save()
    result["summary"] = summarize(runs, a.split)
    save()
    print(table(result))
    plot(result, a.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
