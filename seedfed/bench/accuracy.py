"""Accuracy benchmark on SST-2 + MiniLM: federated ZO through the real round code, beside the
first-order references, on the benchmark's held-out test split.

Every federated ZO method is `seedfed simulate` on the in-process engine (`simulate.driver.run` with
`engine="inprocess"`): the coordinator (SQLite), the ServerApp strategy, the ClientApp over
the device core and the coordinator's round close, the same code as a deployment, with only the
transport removed. The first-order references train on exactly the examples the simulated
devices hold (`DeviceData` partitions of the same pool):

- zero_shot:      version 0 (the prototype head from the label descriptions).
- probe:          first-order linear probe (logistic regression) on the frozen embeddings.
- fo_full:        first-order full fine-tune, centralized (AdamW on the whole model): the ceiling.
- fedavg_fo_lora: first-order FedAvg of LoRA (each device backprop + AdamW, weights averaged).
- fed_zo_head, fed_zo_head_int8, fed_zo_head_int4: federated ZO of the head recipe
                  (seedfed.shared.protocol.recipes) on the fp32, int8 and int4 shared model.
- fed_zo_body, fed_zo_body_int8, fed_zo_body_int4: the body recipe (`--recipe body`:
                  LoRA on the top layer's FFN output beside the head, per-tensor step scales)
                  on the fp32, int8 and int4 shared model (float adapters over quantized base
                  weights). It does not beat the head recipe yet: docs/accuracy.md.

    seedfed bench accuracy --data PATH/sst2/train.tsv --repeats 3     # everything
    seedfed bench accuracy --data ... --methods zero_shot,fed_zo_head --rounds 20   # a look
    seedfed bench accuracy --data ... --on-validation ...             # tune on validation

Writes JSON (--out), a PNG beside it (accuracy against wall time and against example-forwards)
and prints a table with model calls, example-forwards and wall time beside each method.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seedfed.bench.registry import RESULTS, bench_parser
from seedfed.bench.report import write_json
from seedfed.client.data import Examples, train_batches
from seedfed.client.device_data import DeviceData, dataset_splits, load_device_examples
from seedfed.client.evaluate import accuracy
from seedfed.shared.model.factory import ModelBundle, build_model
from seedfed.shared.model.objectives import classification_loss
from seedfed.shared.protocol import recipes
from seedfed.shared.protocol.scope_options import options_for
from seedfed.shared.protocol.task import TaskSpec

ZO_METHODS = ("fed_zo_head", "fed_zo_head_int8", "fed_zo_head_int4",
              "fed_zo_body", "fed_zo_body_int8", "fed_zo_body_int4")
FO_METHODS = ("zero_shot", "probe", "fo_full", "fedavg_fo_lora")
ALL_METHODS = FO_METHODS + ZO_METHODS


@dataclass(frozen=True)
class Fleet:
    """The simulated fleet's data: the same for every method."""

    data: Path
    devices: int = 20
    alpha: float = 0.5
    pool: int = 8000  # training examples spread over the devices (0: the whole split)
    test_size: int = 1000
    seed: int = 0  # the split's pool and the Dirichlet partition
    on_validation: bool = False

    def device_data(self) -> DeviceData:
        return DeviceData(source=str(self.data), num_partitions=self.devices, alpha=self.alpha,
                          seed=self.seed, pool=self.pool)

    def train_sets(self) -> list[Examples]:
        """What each simulated device trains on (its partition less its local held-out)."""
        base = self.device_data()
        return [load_device_examples(replace(base, partition_id=i))[0]
                for i in range(self.devices)]

    def test(self) -> Examples:
        splits = dataset_splits(str(self.data))
        held = splits.validation if self.on_validation else splits.test
        return held.subset(range(min(self.test_size, len(held))))


@dataclass
class Curve:
    method: str
    points: list[dict[str, float]] = field(default_factory=list)  # round/x, seconds, accuracy
    final_accuracy: float = 0.0
    model_calls: int = 0  # probes (ZO: two per seed) or backprop steps (FO)
    example_forwards: int = 0  # sum of batch sizes over model calls
    wall_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- federated ZO: seedfed simulate, in process --------------------------------------------------
def _zo_recipe(method: str) -> str:
    return "body" if method.startswith("fed_zo_body") else "sst2"


def _zo_format(method: str) -> str:
    return method.rsplit("_", 1)[1] if method.endswith(("int8", "int4")) else "fp32"


def fed_zo(method: str, fleet: Fleet, model: str | None, rounds: int | None, eval_every: int,
           out_dir: Path, training_run: int = 0) -> Curve:
    """One federated ZO run of the method's recipe through `simulate.driver.run`;
    `training_run` k of a repeat gives it its own task secret (round seeds, batches)."""
    from seedfed.simulate.config import SimulationConfig
    from seedfed.simulate.driver import run

    recipe = recipes.resolve_recipe(_zo_recipe(method), {"spec.format": _zo_format(method)},
                                    model=model)
    spec = recipe.spec
    n_rounds = rounds or recipe.fleet.rounds
    per_round = min(recipe.fleet.devices_per_round or fleet.devices, fleet.devices)
    config = SimulationConfig(
        out=out_dir, devices=fleet.devices, rounds=n_rounds, model=model, data=str(fleet.data),
        alpha=fleet.alpha, recipe=recipe.recipe, format=spec.format, seed=fleet.seed,
        training_run=training_run, devices_per_round=per_round,
        eval_size=fleet.test_size, engine="inprocess", pool=fleet.pool,
        eval_every=eval_every, sync_after_round=False,
        eval_on_validation=fleet.on_validation,
        # the shared model is what is measured; a personal part never changes its bits
        # (docs/personalization.md) and would cost every device a training pass a round
        personal="off")
    report = run(config)
    h = spec.hyper
    per_device_calls = (1 if h.one_sided else 2) * h.steps * h.perturbations
    calls = sum(r.participants for r in report.rounds) * per_device_calls
    curve = Curve(method, model_calls=calls, example_forwards=calls * h.batch_size,
                  wall_seconds=report.wall_seconds,
                  extra={"scope": spec.scope, "format": spec.format,
                         "scope_numel": report.scope_numel, "rounds": n_rounds,
                         "devices_per_round": per_round,
                         "hyper": asdict(h),
                         "final_checksum": report.final_checksum})
    elapsed = 0.0
    curve.points.append({"round": 0, "seconds": 0.0, "accuracy": report.initial_accuracy or 0})
    for r in report.rounds:
        elapsed += r.seconds
        if r.accuracy is not None:
            curve.points.append({"round": r.round, "seconds": elapsed, "accuracy": r.accuracy})
    curve.final_accuracy = curve.points[-1]["accuracy"]
    return curve


# -- first-order references ----------------------------------------------------------------------
def _bundle(spec: TaskSpec) -> ModelBundle:
    return build_model(spec, initialize=True)


def zero_shot(spec: TaskSpec, test: Examples) -> Curve:
    started = time.perf_counter()
    bundle = _bundle(spec)
    c = Curve("zero_shot", final_accuracy=accuracy(bundle, test).accuracy)
    c.wall_seconds = time.perf_counter() - started
    return c


def probe(spec: TaskSpec, union: Examples, test: Examples) -> Curve:
    """Logistic regression (full-batch Adam) on the frozen sentence embeddings of the pool
    (a sentence-transformers model's mean-pooled embedding: `MeanPoolClassifier.embed`)."""
    from seedfed.client.data import tokenize

    started = time.perf_counter()
    bundle = _bundle(spec)
    model: Any = bundle.model
    if not hasattr(model, "embed"):
        raise SystemExit(f"method probe needs a mean-pooling sentence model, not "
                         f"{type(model).__name__}")
    with torch.no_grad():
        feats = torch.cat([model.embed(**tokenize(bundle.tokenizer, union.texts[i:i + 128],
                                                  None, spec.max_seq_len))
                           for i in range(0, len(union), 128)])
    y = torch.as_tensor(union.labels)
    head = model.classifier
    w = head.weight.detach().clone().requires_grad_(True)
    b = head.bias.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([w, b], lr=0.05)
    for _ in range(1000):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(feats @ w.T + b, y).backward()
        opt.step()
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(b)
    c = Curve("probe", final_accuracy=accuracy(bundle, test).accuracy,
              model_calls=len(range(0, len(union), 128)), example_forwards=len(union))
    c.wall_seconds = time.perf_counter() - started
    return c


def _adamw_step(bundle: ModelBundle, opt: torch.optim.Optimizer, batch: dict[str, Any],
                curve: Curve) -> None:
    """One backprop + AdamW step on a batch, counted in the curve."""
    loss = classification_loss(bundle.model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    curve.model_calls += 1
    curve.example_forwards += int(batch["labels"].shape[0])


def _score(curve: Curve, bundle: ModelBundle, test: Examples, done: int, total: int,
           started: float) -> None:
    with torch.no_grad():
        acc = accuracy(bundle, test).accuracy
    curve.points.append({"round": done, "seconds": time.perf_counter() - started,
                         "accuracy": acc})
    _log(f"  {curve.method} {done}/{total}: {acc:.4f}")


def fo_full(spec: TaskSpec, union: Examples, test: Examples, epochs: int, lr: float,
            batch: int, seed: int) -> Curve:
    """Centralized first-order fine-tune of the whole model (AdamW): the ceiling."""
    started = time.perf_counter()
    bundle = _bundle(replace(spec, scope="full", scope_options=options_for("full"), step_scales=()))
    params = [t.tensor for t in bundle.scope]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    stream = train_batches(union, bundle.tokenizer, batch, spec.max_seq_len,
                           np.random.default_rng([seed, 8]))
    steps = epochs * math.ceil(len(union) / batch)
    c = Curve("fo_full", extra={"epochs": epochs, "lr": lr, "batch_size": batch})
    bundle.model.eval()  # dropout off, as in the ZO runs
    for step in range(steps):
        _adamw_step(bundle, opt, next(stream), c)
        if (step + 1) % max(1, steps // 4) == 0 or step + 1 == steps:
            _score(c, bundle, test, step + 1, steps, started)
    c.final_accuracy = c.points[-1]["accuracy"]
    c.wall_seconds = time.perf_counter() - started
    return c


def fedavg_fo_lora(spec: TaskSpec, train_sets: list[Examples], test: Examples, rounds: int,
                   local_steps: int, lr: float, batch: int, seed: int) -> Curve:
    """First-order FedAvg of LoRA: every device runs backprop + a fresh AdamW from the global
    adapter, the coordinator averages the adapters by example count (FedAvg's n_k)."""
    started = time.perf_counter()
    bundle = _bundle(replace(spec, scope="lora", scope_options=options_for("lora"), step_scales=()))
    scope, params = bundle.scope, [t.tensor for t in bundle.scope]
    streams = [train_batches(d, bundle.tokenizer, batch, spec.max_seq_len,
                             np.random.default_rng([seed, 6, i]))
               for i, d in enumerate(train_sets)]
    c = Curve("fedavg_fo_lora", extra={"rounds": rounds, "local_steps": local_steps, "lr": lr,
                                       "scope_numel": scope.numel})
    bundle.model.eval()
    for r in range(rounds):
        global_state = scope.read()
        summed = {n: torch.zeros_like(v) for n, v in global_state.items()}
        total = 0
        for d, data in enumerate(train_sets):
            scope.write(global_state)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
            for _ in range(local_steps):
                _adamw_step(bundle, opt, next(streams[d]), c)
            for p in params:
                p.requires_grad_(False)
                p.grad = None
            for n, v in scope.read().items():
                summed[n] += len(data) * v
            total += len(data)
        scope.write({n: v / total for n, v in summed.items()})
        if (r + 1) % max(1, rounds // 4) == 0 or r + 1 == rounds:
            _score(c, bundle, test, r + 1, rounds, started)
    c.final_accuracy = c.points[-1]["accuracy"]
    c.wall_seconds = time.perf_counter() - started
    return c


# -- report --------------------------------------------------------------------------------------
def plot(curves: list[Curve], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, c in enumerate(curves):
        if len(c.points) > 1:
            ax1.plot([p["seconds"] / 60 for p in c.points], [p["accuracy"] for p in c.points],
                     marker="o", ms=3, color=f"C{i}", label=c.method)
        ax2.bar(i, c.final_accuracy, color=f"C{i}")
    ax1.set_xlabel("wall time (minutes, 2 shared cores)")
    ax1.set_ylabel("held-out accuracy")
    ax1.set_title("Accuracy against wall time")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set_xticks(range(len(curves)), [c.method for c in curves], rotation=30, ha="right",
                   fontsize=8)
    lo = min((c.final_accuracy for c in curves), default=0.5)
    ax2.set_ylim(max(0.0, lo - 0.05), 1.0)
    ax2.set_ylabel("final held-out accuracy")
    ax2.set_title("SST-2, MiniLM-L6, 20 Dirichlet(0.5) devices")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(curves: list[Curve], repeats: dict[str, list[float]]) -> str:
    lines = [f"{'method':18s} {'accuracy':>8s} {'runs':>21s} {'model calls':>11s} "
             f"{'example-fwd':>12s} {'wall s':>8s}"]
    for c in curves:
        runs = repeats.get(c.method, [c.final_accuracy])
        spread = " ".join(f"{a:.3f}" for a in runs)
        lines.append(f"{c.method:18s} {float(np.mean(runs)):8.4f} {spread:>21s} "
                     f"{c.model_calls:11d} {c.example_forwards:12d} {c.wall_seconds:8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("accuracy")
    ap.add_argument("--data", type=Path, required=True, help="SST-2 train.tsv (label, sentence)")
    ap.add_argument("--model", default=None, help="local HF dir (default: packaged MiniLM)")
    ap.add_argument("--out", type=Path, default=RESULTS / "accuracy.json")
    ap.add_argument("--methods", default=",".join(ALL_METHODS))
    ap.add_argument("--devices", type=int, default=Fleet.devices)
    ap.add_argument("--alpha", type=float, default=Fleet.alpha)
    ap.add_argument("--pool", type=int, default=Fleet.pool)
    ap.add_argument("--test-size", type=int, default=Fleet.test_size)
    ap.add_argument("--rounds", type=int, default=None, help="ZO rounds (default: recipe's)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=1, help="independent training runs of each "
                    "ZO method (each its own task secret, so other seeds and batches); mean "
                    "reported")
    ap.add_argument("--fo-epochs", type=int, default=1)
    ap.add_argument("--fo-lr", type=float, default=5e-5)
    ap.add_argument("--fedavg-rounds", type=int, default=20)
    ap.add_argument("--fedavg-steps", type=int, default=4)
    ap.add_argument("--fedavg-lr", type=float, default=1e-3)
    ap.add_argument("--on-validation", action="store_true",
                    help="score the validation split (for tuning) instead of the test split")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(ALL_METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {ALL_METHODS}")
    fleet = Fleet(data=args.data, devices=args.devices, alpha=args.alpha, pool=args.pool,
                  test_size=args.test_size, seed=args.seed, on_validation=args.on_validation)
    test = fleet.test()
    head_spec = recipes.resolve_recipe("sst2", model=args.model).spec
    curves: list[Curve] = []
    repeats: dict[str, list[float]] = {}
    if set(methods) & set(FO_METHODS):
        train_sets = fleet.train_sets()
        union = Examples(tuple(t for d in train_sets for t in d.texts),
                         np.concatenate([d.labels for d in train_sets]))
        _log(f"{len(union)} training examples on {fleet.devices} devices, test {len(test)}")
    if "zero_shot" in methods:
        curves.append(zero_shot(head_spec, test))
    if "probe" in methods:
        curves.append(probe(head_spec, union, test))
    if "fo_full" in methods:
        curves.append(fo_full(head_spec, union, test, args.fo_epochs, args.fo_lr, 32, args.seed))
    if "fedavg_fo_lora" in methods:
        curves.append(fedavg_fo_lora(head_spec, train_sets, test, args.fedavg_rounds,
                                     args.fedavg_steps, args.fedavg_lr, 16, args.seed))
    for method in (m for m in ZO_METHODS if m in methods):
        runs = []
        for k in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix=f"{method}-") as tmp:
                _log(f"{method} run {k + 1}/{args.repeats}")
                runs.append(fed_zo(method, fleet, args.model, args.rounds, args.eval_every,
                                   Path(tmp) / "run", training_run=k))
                _log(f"{method} run {k + 1}: {runs[-1].final_accuracy:.4f} "
                     f"({[round(p['accuracy'], 3) for p in runs[-1].points]})")
        curves.append(runs[0])  # the first run's curve is plotted
        repeats[method] = [r.final_accuracy for r in runs]
        _log(f"{method}: {repeats[method]}")
    result = {"benchmark": "accuracy", "fleet": {k: str(v) for k, v in asdict(fleet).items()},
              "split": "validation" if args.on_validation else "test",
              "torch_threads": torch.get_num_threads(),
              "methods": {c.method: asdict(c) for c in curves},
              "repeats": {m: {"accuracy": a, "mean": float(np.mean(a)), "sd": float(np.std(a))}
                          for m, a in repeats.items()}}
    write_json(args.out, result, newline=False, default=str)
    plot(curves, args.out.with_suffix(".png"))
    print(table(curves, repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
