"""Accuracy benchmark: federated ZO vs centralized ZO vs first-order FedAvg on SST-2 + MiniLM.

One run, side by side, on one fixed split carved from ../shared/data/sst2/train.tsv:

- fed_zo:     the in-process federated loop. Each round samples devices; each runs
              `LocalTrainer.run` on its Dirichlet(alpha) partition with the round's seeds; the
              coordinator math (`build_entry` + `apply_seeds`) turns the scalars into the shared
              update -- exactly what the coordinator runs, without the transport.
- central_zo: one device holding the union of the partitions, the same recipe and the same
              number of example-forwards (`--central-batch`: the round's pooled batch by default,
              i.e. as many seeds and model calls of K x B examples as the fleet; or B to spend
              the same budget on K times as many steps of the device batch).
- fedavg_fo:  first-order FedAvg: each sampled device runs backprop + AdamW on its partition
              from the global weights, the coordinator averages weights by example count.
- zero_shot:  version 0 (prototype head from the label descriptions), and
- probe:      a logistic-regression probe on the frozen sentence embeddings of the same pool.

Writes JSON (--out), prints a table and saves a PNG next to the JSON.

    python benchmarks/accuracy.py                      # the recipe of docs/accuracy.md
    python benchmarks/accuracy.py --rounds 50 --methods fed_zo,zero_shot   # quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from seedfed.client import recipes  # noqa: E402
from seedfed.client.data import (
    Examples,
    dirichlet_partition,
    load_labelled,
    split,
    train_batches,  # noqa: E402
)
from seedfed.client.evaluate import accuracy, warm_cache  # noqa: E402
from seedfed.client.trainer import LocalTrainer, classification_loss  # noqa: E402
from seedfed.shared.aggregate import build_entry  # noqa: E402
from seedfed.shared.models import ModelBundle, build_model  # noqa: E402
from seedfed.shared.replay import apply_seeds, checksum  # noqa: E402
from seedfed.shared.task import TaskSpec  # noqa: E402
from seedfed.shared.wire import RoundPlan  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "train.tsv"
SEED_LIMIT = 1 << 53  # wire seeds stay exact in JSON doubles (shared.wire.Seed)


@dataclass(frozen=True)
class FedConfig:
    devices: int = 20
    alpha: float = 0.5
    train_pool: int = 8000  # training examples spread over the devices
    test_size: int = 1000
    rounds: int = 300
    per_round: int = 5  # devices sampled per round
    eval_every: int = 50
    seed: int = 0  # the split and the partition
    run_seed: int = 0  # the training randomness: device sampling, batches, perturbation seeds


@dataclass
class Curve:
    method: str
    points: list[dict[str, float]] = field(default_factory=list)  # x, accuracy, loss
    final_accuracy: float = 0.0
    forwards: int = 0  # model calls (each on one batch)
    example_forwards: int = 0  # sum of batch sizes over model calls
    wall_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def carve(data: Path, cfg: FedConfig) -> tuple[Examples, list[np.ndarray], Examples, Examples]:
    """(training pool, device partitions of it, validation, test): all fixed by cfg.seed."""
    splits = split(load_labelled(data))
    rng = np.random.default_rng([cfg.seed, 1])
    pool_idx = np.sort(rng.permutation(len(splits.train))[:cfg.train_pool])
    pool = splits.train.subset(pool_idx)
    parts = dirichlet_partition(pool.labels, cfg.devices, cfg.alpha, rng, min_size=4)
    test = splits.test.subset(range(min(cfg.test_size, len(splits.test))))
    return pool, parts, splits.validation, test


def _seeds(rng: np.random.Generator, steps: int, perturbations: int) -> list[list[int]]:
    return rng.integers(0, SEED_LIMIT, size=(steps, perturbations), dtype=np.uint64).tolist()


def _eval(curve: Curve, bundle: ModelBundle, test: Examples, x: float, loss: float) -> None:
    acc = accuracy(bundle, test).accuracy
    curve.points.append({"x": x, "accuracy": acc, "loss": loss})
    _log(f"  {curve.method:11s} x={x:>9.0f} acc={acc:.4f} loss={loss:.4f}")


class Models:
    """One model per scope, built once, its version 0 kept: every method restarts from the same
    version 0 and shares the per-example feature cache (each example is encoded once, as a
    device encodes its private examples once when only the top of the model trains)."""

    def __init__(self) -> None:
        self._built: dict[str, tuple[ModelBundle, dict[str, torch.Tensor]]] = {}

    def get(self, spec: TaskSpec) -> ModelBundle:
        key = json.dumps(replace(spec, hyper=replace(spec.hyper, batch_size=1)).to_dict(),
                         sort_keys=True, default=str)
        if key not in self._built:
            bundle = build_model(spec, initialize=True)
            self._built[key] = (bundle, bundle.scope.read())
        bundle, v0 = self._built[key]
        bundle.scope.write(v0)
        bundle.spec = spec
        return bundle


def fed_zo(bundle: ModelBundle, pool: Examples, parts: list[np.ndarray], test: Examples,
           cfg: FedConfig) -> Curve:
    """Federated ZO, in process: the coordinator's math on the devices' scalars."""
    spec = bundle.spec
    hyper = spec.hyper
    trainer = LocalTrainer(bundle.model, bundle.scope, classification_loss)
    device_data = [pool.subset(p) for p in parts]
    streams = [train_batches(d, bundle.tokenizer, hyper.batch_size, spec.max_seq_len,
                             np.random.default_rng([cfg.seed, 2, i, cfg.run_seed]))
               for i, d in enumerate(device_data)]
    rng = np.random.default_rng([cfg.seed, 3, cfg.run_seed])
    curve = Curve("fed_zo", extra={"scope_numel": bundle.scope.numel,
                                   "upload_bytes_per_device_round": 4 * hyper.steps
                                   * hyper.perturbations})
    started = time.perf_counter()
    _eval(curve, bundle, test, 0, math.nan)
    losses: list[float] = []
    for r in range(cfg.rounds):
        chosen = rng.choice(cfg.devices, size=cfg.per_round, replace=False)
        plan = RoundPlan(task_id="bench", round=r, version=r,
                         seeds=_seeds(rng, hyper.steps, hyper.perturbations), lr=hyper.lr,
                         eps=hyper.eps, batch_size=hyper.batch_size, scope=spec.scope)
        g, weights = [], []
        for d in chosen:
            res = trainer.run(plan, streams[d])
            g.append(res.scalars.reshape(-1))
            weights.append(len(device_data[d]))  # n_k, as the devices report it
            losses.append(res.loss)
            curve.forwards += res.forwards
            curve.example_forwards += res.forwards * res.num_examples // hyper.steps
        entry = build_entry("bench", r, plan.flat_seeds, np.stack(g), np.array(weights, float),
                            hyper.lr, hyper.perturbations, spec.aggregation)
        apply_seeds(bundle.scope, entry.seeds, entry.coefs)
        if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
            _eval(curve, bundle, test, curve.example_forwards, float(np.mean(losses)))
            losses = []
    curve.wall_seconds = time.perf_counter() - started
    curve.final_accuracy = curve.points[-1]["accuracy"]
    curve.extra["final_checksum"] = checksum(bundle.scope)
    return curve


def central_zo(models: Models, spec: TaskSpec, pool: Examples, parts: list[np.ndarray],
               test: Examples, cfg: FedConfig, budget: int, batch: int) -> Curve:
    """One device with all the data, the same recipe, `budget` example-forwards."""
    hyper = replace(spec.hyper, batch_size=batch)
    bundle = models.get(replace(spec, hyper=hyper))
    trainer = LocalTrainer(bundle.model, bundle.scope, classification_loss)
    union = pool.subset(np.sort(np.concatenate(parts)))
    stream = train_batches(union, bundle.tokenizer, batch, spec.max_seq_len,
                           np.random.default_rng([cfg.seed, 4, cfg.run_seed]))
    rng = np.random.default_rng([cfg.seed, 5, cfg.run_seed])
    per_step = 2 * hyper.perturbations * batch
    total_steps = max(1, budget // per_step)
    chunk = max(1, total_steps // max(1, cfg.rounds // cfg.eval_every))
    curve = Curve(f"central_zo_b{batch}")
    started = time.perf_counter()
    _eval(curve, bundle, test, 0, math.nan)
    done = 0
    while done < total_steps:
        n = min(chunk, total_steps - done)
        plan = RoundPlan(task_id="bench", round=done, version=done,
                         seeds=_seeds(rng, n, hyper.perturbations), lr=hyper.lr, eps=hyper.eps,
                         batch_size=batch, scope=spec.scope)
        res = trainer.run(plan, stream, keep=True)
        done += n
        curve.forwards += res.forwards
        curve.example_forwards += res.forwards * batch
        _eval(curve, bundle, test, curve.example_forwards, res.loss)
    curve.wall_seconds = time.perf_counter() - started
    curve.final_accuracy = curve.points[-1]["accuracy"]
    return curve


def fedavg_fo(bundle: ModelBundle, pool: Examples, parts: list[np.ndarray], test: Examples,
              cfg: FedConfig, rounds: int, local_steps: int, lr: float, batch: int) -> Curve:
    """First-order FedAvg of the bundle's scope: each sampled device runs backprop + a fresh
    AdamW from the global weights, the coordinator averages the scope by example count."""
    model, scope = bundle.model, bundle.scope
    params = [t.tensor for t in scope]
    device_data = [pool.subset(p) for p in parts]
    streams = [train_batches(d, bundle.tokenizer, batch, bundle.spec.max_seq_len,
                             np.random.default_rng([cfg.seed, 6, i, cfg.run_seed]))
               for i, d in enumerate(device_data)]
    rng = np.random.default_rng([cfg.seed, 7, cfg.run_seed])
    curve = Curve(f"fedavg_fo_{bundle.spec.scope}", extra={
        "rounds": rounds, "local_steps": local_steps, "lr": lr, "batch_size": batch,
        "scope_numel": scope.numel})
    started = time.perf_counter()
    _eval(curve, bundle, test, 0, math.nan)
    every = max(1, rounds // 6)
    model.eval()  # dropout off, as in the ZO runs
    for r in range(rounds):
        chosen = rng.choice(cfg.devices, size=cfg.per_round, replace=False)
        global_state = scope.read()
        summed = {n: torch.zeros_like(v) for n, v in global_state.items()}
        total, losses = 0, []
        for d in chosen:
            scope.write(global_state)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
            n_ex = 0
            for _ in range(local_steps):
                b = next(streams[d])
                loss = classification_loss(model, b)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                n_ex += int(b["labels"].shape[0])
                curve.forwards += 1
                curve.example_forwards += int(b["labels"].shape[0])
            for p in params:
                p.requires_grad_(False)
                p.grad = None
            for n, v in scope.read().items():  # weighted by n_k, as FedAvg
                summed[n] += len(device_data[d]) * v
            total += len(device_data[d])
        scope.write({n: v / total for n, v in summed.items()})
        if (r + 1) % every == 0 or r + 1 == rounds:
            _eval(curve, bundle, test, curve.example_forwards, float(np.mean(losses)))
    curve.wall_seconds = time.perf_counter() - started
    curve.final_accuracy = curve.points[-1]["accuracy"]
    return curve


def zero_shot_and_probe(models: Models, spec: TaskSpec, pool: Examples,
                        parts: list[np.ndarray], test: Examples) -> tuple[Curve, Curve]:
    """Version 0, and a logistic-regression probe (full-batch Adam) on frozen embeddings."""
    bundle = models.get(replace(spec, scope="named", scope_options={"patterns": ("classifier",)}))
    started = time.perf_counter()
    zs = Curve("zero_shot")
    zs.final_accuracy = accuracy(bundle, test).accuracy
    zs.wall_seconds = time.perf_counter() - started
    union = pool.subset(np.sort(np.concatenate(parts)))
    model: Any = bundle.model
    started = time.perf_counter()
    with torch.no_grad():
        feats = torch.cat([_embed(bundle, union.texts[i:i + 128])
                           for i in range(0, len(union), 128)])
    y = torch.as_tensor(union.labels)
    head = model.classifier
    w0, b0 = head.weight.detach().clone(), head.bias.detach().clone()
    w, b = w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    opt = torch.optim.Adam([w, b], lr=0.05)
    for _ in range(1000):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(feats @ w.T + b, y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(b)
    probe = Curve("probe", extra={"train_examples": len(union)})
    probe.final_accuracy = accuracy(bundle, test).accuracy
    probe.wall_seconds = time.perf_counter() - started
    return zs, probe


def _embed(bundle: ModelBundle, texts: tuple[str, ...]) -> torch.Tensor:
    from seedfed.client.data import tokenize

    batch = tokenize(bundle.tokenizer, texts, None, bundle.spec.max_seq_len)
    return bundle.model.embed(**batch)  # type: ignore[operator]


def plot(curves: list[Curve], refs: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in curves:
        if c.points:
            ax.plot([p["x"] for p in c.points], [p["accuracy"] for p in c.points],
                    marker="o", ms=3, label=c.method)
    for i, (name, acc) in enumerate(refs.items()):
        ax.axhline(acc, ls="--", lw=1, color=f"C{len(curves) + i}", label=f"{name} {acc:.3f}")
    ax.set_xscale("symlog", linthresh=1000)  # FO needs orders of magnitude fewer forwards
    ax.set_xlim(left=0)
    ax.set_xlabel("example-forwards (sum of batch sizes over model calls, log)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("SST-2, MiniLM-L6, Dirichlet non-IID devices")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", default=None, help="local HF dir (default: packaged MiniLM)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/accuracy.json"))
    ap.add_argument("--methods", default="zero_shot,probe,fed_zo,central_zo,fedavg_fo",
                    help="also: fedavg_fo_full (first-order FedAvg of the whole model; slow)")
    ap.add_argument("--devices", type=int, default=FedConfig.devices)
    ap.add_argument("--alpha", type=float, default=FedConfig.alpha)
    ap.add_argument("--train-pool", type=int, default=FedConfig.train_pool)
    ap.add_argument("--test-size", type=int, default=FedConfig.test_size)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--per-round", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--scope", default=None)
    ap.add_argument("--patterns", default=None, help="comma list for the named scope")
    ap.add_argument("--scope-options", default=None,
                    help='JSON scope options, e.g. \'{"layers": ["encoder.layer.5."]}\'')
    ap.add_argument("--format", default=None, choices=["fp32", "int8", "int4"],
                    help="shared model format: int8/int4 quantize the encoder's Linear layers")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--eps", type=float, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--perturbations", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--central-batch", default="pooled", help="pooled, device, or both")
    ap.add_argument("--fo-rounds", type=int, default=30)
    ap.add_argument("--fo-steps", type=int, default=4)
    ap.add_argument("--fo-lr", type=float, default=1e-2, help="AdamW lr on the ZO scope")
    ap.add_argument("--fo-full-rounds", type=int, default=5)
    ap.add_argument("--fo-full-lr", type=float, default=5e-5, help="AdamW lr, whole model")
    ap.add_argument("--on-validation", action="store_true", help="score on the validation "
                    "split (for tuning) instead of the test split")
    ap.add_argument("--fo-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the ZO methods this many times (training seeds 0..R-1, same "
                         "split) and report mean and sd")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    recipe = recipes.sst2_recipe(args.model)
    spec = recipe.spec
    hyper = spec.hyper
    hyper = replace(hyper, **{k: v for k, v in {
        "lr": args.lr, "eps": args.eps, "steps": args.steps, "perturbations": args.perturbations,
        "batch_size": args.batch_size}.items() if v is not None})
    changes: dict[str, Any] = {"hyper": hyper}
    if args.scope:
        changes["scope"] = args.scope
        changes["scope_options"] = {}
    if args.patterns:
        changes["scope_options"] = {"patterns": tuple(args.patterns.split(","))}
    if args.scope_options:
        changes["scope_options"] = json.loads(args.scope_options)
    if args.format:
        changes["format"] = args.format
    if args.max_len:
        changes["max_seq_len"] = args.max_len
    spec = replace(spec, **changes)
    cfg = FedConfig(devices=args.devices, alpha=args.alpha, train_pool=args.train_pool,
                    test_size=args.test_size, rounds=args.rounds or recipe.rounds,
                    per_round=args.per_round or recipe.per_round, seed=args.seed,
                    eval_every=args.eval_every or max(1, (args.rounds or recipe.rounds) // 6))
    methods = args.methods.split(",")
    pool, parts, val, test = carve(args.data, cfg)
    if args.on_validation:
        test = val.subset(range(min(cfg.test_size, len(val))))
    _log(f"pool {len(pool)} examples on {cfg.devices} devices (sizes "
         f"{min(len(p) for p in parts)}..{max(len(p) for p in parts)}), test {len(test)}")
    _log(f"spec: scope={spec.scope} {spec.scope_options} hyper={spec.hyper}")
    curves: list[Curve] = []
    refs: dict[str, float] = {}
    models = Models()
    started = time.perf_counter()
    bundle = models.get(spec)
    if getattr(bundle.model, "frozen_prefix", 0):
        warm_cache(bundle, test)
        warm_cache(bundle, pool)
    _log(f"model + feature cache ready in {time.perf_counter() - started:.0f} s")
    if "zero_shot" in methods or "probe" in methods:
        zs, probe = zero_shot_and_probe(models, spec, pool, parts, test)
        refs = {"zero_shot": zs.final_accuracy, "probe": probe.final_accuracy}
        curves_ref = [zs, probe]
        _log(f"zero-shot {zs.final_accuracy:.4f}  probe {probe.final_accuracy:.4f}")
    else:
        curves_ref = []
    repeats: dict[str, list[float]] = {}
    for run_seed in range(args.repeats):  # the first run's curves are plotted
        run_cfg = replace(cfg, run_seed=run_seed)
        zo_curves: list[Curve] = []
        fed = None
        if "fed_zo" in methods:
            fed = fed_zo(models.get(spec), pool, parts, test, run_cfg)
            zo_curves.append(fed)
        if "central_zo" in methods:
            budget = fed.example_forwards if fed else (
                cfg.rounds * cfg.per_round * hyper.steps * 2 * hyper.perturbations
                * hyper.batch_size)
            batches = {"pooled": [cfg.per_round * hyper.batch_size],
                       "device": [hyper.batch_size],
                       "both": [cfg.per_round * hyper.batch_size, hyper.batch_size]}
            for b in batches[args.central_batch]:
                zo_curves.append(central_zo(models, spec, pool, parts, test, run_cfg, budget, b))
        for c in zo_curves:
            repeats.setdefault(c.method, []).append(c.final_accuracy)
        if run_seed == 0:
            curves += zo_curves
    if "fedavg_fo" in methods:
        curves.append(fedavg_fo(models.get(spec), pool, parts, test, cfg, args.fo_rounds,
                                args.fo_steps, args.fo_lr, args.fo_batch))
    if "fedavg_fo_full" in methods:
        curves.append(fedavg_fo(models.get(replace(spec, scope="full", scope_options={})),
                                pool, parts, test, cfg, args.fo_full_rounds, args.fo_steps,
                                args.fo_full_lr, args.fo_batch))
    result = {
        "benchmark": "accuracy", "data": str(args.data), "config": asdict(cfg),
        "spec": spec.to_dict(), "torch_threads": torch.get_num_threads(),
        "methods": {c.method: asdict(c) for c in curves_ref + curves},
        "repeats": {m: {"accuracy": a, "mean": float(np.mean(a)), "sd": float(np.std(a))}
                    for m, a in repeats.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    plot(curves, refs, args.out.with_suffix(".png"))
    print(f"{'method':14s} {'accuracy':>8s} {'model calls':>11s} {'example-fwd':>11s} "
          f"{'wall s':>8s}")
    for c in curves_ref + curves:
        print(f"{c.method:14s} {c.final_accuracy:8.4f} {c.forwards:11d} {c.example_forwards:11d} "
              f"{c.wall_seconds:8.1f}")
    if args.repeats > 1:
        for m, a in repeats.items():
            print(f"{m:14s} over {len(a)} training seeds: mean {np.mean(a):.4f} "
                  f"sd {np.std(a):.4f} ({' '.join(f'{x:.3f}' for x in a)})")
    return result


if __name__ == "__main__":
    main()
