"""Fast sweep of the head-only ZO recipe on cached sentence embeddings (for tuning).

The SST-2 recipe trains only the classifier head (a Linear on the frozen, mean-pooled,
normalized MiniLM embedding), so every probe is a 16 x 384 x 2 matmul once the embeddings are
cached. This script runs the same math as `seedfed.bench.accuracy` -- the same split and
Dirichlet partition (`carve`), Rademacher z, two-point estimate, coef = -(lr/P) g, weighted mean
over the sampled devices -- with all P perturbations of a device batched into one einsum, so a
600-round fleet run takes seconds instead of minutes. z and batches come from numpy generators,
not the Philox stream (same distribution, not the same bits): use it to choose, then confirm
with `seedfed.bench.accuracy`. Scores the validation split only.

    seedfed bench head_sweep --lr 1.5 --perturbations 64 --rounds 600 --seeds 8 \
        --weights batch data
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from seedfed.bench.registry import bench_parser
from seedfed.bench.report import write_json
from seedfed.bench.sweep_data import FedConfig, _embed, carve
from seedfed.client.data import Examples
from seedfed.shared.model.factory import build_model
from seedfed.shared.protocol.recipes import resolve_recipe

TEST_SPLIT = False  # --test: score the benchmark's test split (only to confirm a choice)


@dataclass(frozen=True)
class Run:
    lr: float
    perturbations: int
    rounds: int
    batch: int
    weights: str  # "batch": examples in the probe batch; "data": the device's dataset size
    schedule: str = "constant"  # or "cosine": lr * (1 + cos(pi * round / rounds)) / 2
    per_round: int = 5
    eps: float = 1e-3


def features(cache: Path, data: Path, cfg: FedConfig, model: str | None
             ) -> dict[str, torch.Tensor | list[np.ndarray]]:
    """Embeddings of the pool and the validation split, and the partition (cached on disk)."""
    if cache.exists():
        return torch.load(cache, weights_only=False)
    pool, parts, val, test = carve(data, cfg)
    bundle = build_model(resolve_recipe("sst2", model=model).spec, initialize=True)
    with torch.no_grad():
        def embed(ex: Examples) -> torch.Tensor:
            return torch.cat([_embed(bundle, ex.texts[i:i + 128]) for i in range(0, len(ex), 128)])
        head = cast(torch.nn.Linear, bundle.model.classifier)
        out: dict[str, torch.Tensor | list[np.ndarray]] = {
            "pool_x": embed(pool), "pool_y": torch.as_tensor(pool.labels),
            "val_x": embed(val), "val_y": torch.as_tensor(val.labels), "parts": parts,
            "test_x": embed(test), "test_y": torch.as_tensor(test.labels),
            "w0": head.weight.detach().clone(), "b0": head.bias.detach().clone()}
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, cache)
    return out


def losses(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a batch under each of K flat heads theta [K, 2 * d + 2]."""
    d = x.shape[1]
    w = theta[:, : 2 * d].reshape(-1, 2, d)
    b = theta[:, 2 * d:]
    logits = torch.einsum("nd,kcd->knc", x, w) + b[:, None, :]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, 2), y.repeat(theta.shape[0]), reduction="none"
    ).reshape(theta.shape[0], -1).mean(1)


def accuracy(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    d = x.shape[1]
    logits = x @ theta[: 2 * d].reshape(2, d).T + theta[2 * d:]
    return float((logits.argmax(1) == y).float().mean())


def lr_at(r: Run, i: int) -> float:
    if r.schedule == "cosine":
        return r.lr * 0.5 * (1 + np.cos(np.pi * i / r.rounds))
    return r.lr


def run(f: dict, r: Run, seed: int, central: bool) -> float:
    per_round = r.per_round
    rng = np.random.default_rng([seed, 11])
    x, y, parts = f["pool_x"], f["pool_y"], f["parts"]
    theta = torch.cat([f["w0"].reshape(-1), f["b0"]]).double()
    x = x.double()
    union = np.sort(np.concatenate(parts))
    for i in range(r.rounds):
        z = torch.from_numpy(rng.integers(0, 2, size=(r.perturbations, theta.numel())) * 2.0 - 1)
        if central:
            groups = [(rng.choice(union, size=per_round * r.batch, replace=False), 1.0)]
        else:
            chosen = rng.choice(len(parts), size=per_round, replace=False)
            groups = []
            for k in chosen:
                idx = rng.choice(parts[k], size=min(r.batch, len(parts[k])), replace=False)
                groups.append((idx, float(len(idx) if r.weights == "batch" else len(parts[k]))))
        g = torch.zeros(r.perturbations, dtype=torch.float64)
        total = 0.0
        for idx, wgt in groups:
            xb, yb = x[idx], y[idx]
            lp = losses(theta + r.eps * z, xb, yb)
            lm = losses(theta - r.eps * z, xb, yb)
            g += wgt * (lp - lm) / (2 * r.eps)
            total += wgt
        theta = theta - (lr_at(r, i) / r.perturbations) * (g / total) @ z
    split = "test" if TEST_SPLIT else "val"
    return accuracy(theta, f[f"{split}_x"].double(), f[f"{split}_y"])


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("head_sweep")
    ap.add_argument("--data", type=Path, required=True, help="SST-2 train.tsv (label, sentence)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--cache", type=Path, default=None,
                    help="feature cache (default runs/head_sweep_features_<pool>.pt)")
    ap.add_argument("--train-pool", type=int, default=FedConfig.train_pool)
    ap.add_argument("--lr", type=float, nargs="+", default=[1.5])
    ap.add_argument("--perturbations", type=int, nargs="+", default=[64])
    ap.add_argument("--rounds", type=int, nargs="+", default=[600])
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--weights", nargs="+", default=["batch", "data"], choices=["batch", "data"])
    ap.add_argument("--schedule", nargs="+", default=["constant"], choices=["constant", "cosine"])
    ap.add_argument("--per-round", type=int, nargs="+", default=[5])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--test", action="store_true", help="score the test split, not validation")
    args = ap.parse_args(argv)
    global TEST_SPLIT
    TEST_SPLIT = args.test
    cache = args.cache or Path(f"runs/head_sweep_features_{args.train_pool}.pt")
    f = features(cache, args.data, FedConfig(train_pool=args.train_pool), args.model)
    rows = []
    print(f"{'lr':>5} {'P':>4} {'rounds':>6} {'B':>3} {'schedule':>8} {'K':>3} {'weights':>7} "
          f"{'fed mean':>9} {'sd':>6} {'central':>8}")
    for lr, p, rounds, b, sch, k in itertools.product(args.lr, args.perturbations, args.rounds,
                                                      args.batch, args.schedule, args.per_round):
        central = float(np.mean([run(f, Run(lr, p, rounds, b, "batch", sch, k), s, True)
                                 for s in range(args.seeds)]))
        for wts in args.weights:
            accs = [run(f, Run(lr, p, rounds, b, wts, sch, k), s, False)
                    for s in range(args.seeds)]
            rows.append({"lr": lr, "perturbations": p, "rounds": rounds, "batch": b,
                         "schedule": sch, "per_round": k, "weights": wts, "fed": accs,
                         "central_mean": central})
            print(f"{lr:5.2f} {p:4d} {rounds:6d} {b:3d} {sch:>8} {k:3d} {wts:>7} "
                  f"{np.mean(accs):9.4f} {np.std(accs):6.4f} {central:8.4f}", flush=True)
    if args.json:
        write_json(args.json, rows, newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
