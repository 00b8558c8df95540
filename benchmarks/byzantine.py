"""Byzantine fleets: how each aggregation rule trains when 10-30% of the devices lie.

The SST-2 head recipe (`client.recipes.sst2_recipe`: MiniLM head scope, lr 4, eps 1e-3, one
step of P = 64 perturbations, batch 16, all 20 Dirichlet(0.5) devices in every round) run on
cached sentence embeddings, as `benchmarks/head_sweep.py` does: same split and partition
(`carve`), Rademacher z, two-point estimates, coef = -(lr / P) * AGG_d g_d. AGG is the
coordinator's own `seedfed.shared.aggregate.aggregate` with the weights the coordinator uses
(each device's num_examples, capped at the task's `max_num_examples`). z and batches come from
numpy generators, not the Philox stream (same distribution, not the same bits).

A fraction of the devices (the same devices for every rule, nested: the 10% are among the 20%)
replace their honest estimate g_d with:

    extreme     -sign(g_d) * B: the largest magnitude the coordinator accepts (B = the hard
                limit, `Settings.scalar_hard_limit`), against their own gradient estimate
    sign_flip   -g_d (honest magnitude, wrong direction)
    constant    +B/10 for every seed (a stuck or scripted device)
    colluding   all send the same mu - z_max * sigma * sign(mu) per seed, from the honest
                devices' mean and spread ("a little is enough", Baruch et al. 2019): inside the
                honest spread, so trimming and medians do not see it as an outlier
    inflated    -g_d claiming num_examples = the task's cap (the default 100,000 unless the
                rule row says otherwise), to buy the weight

Output: per rule, attack and fraction, validation loss and accuracy every `--eval-every`
rounds (JSON), a PNG of the curves, and a table of final accuracies with "held" = within
`--tolerance` of the clean fleet under the same rule and the validation loss not above its
value at version 0.

    python benchmarks/byzantine.py                      # full: 150 rounds, ~5 min on 2 cores
    python benchmarks/byzantine.py --synthetic --rounds 40   # no model: synthetic features
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_sweep import losses  # noqa: E402  (the head sweep's batched two-point loss)
from seedfed.shared.aggregate import AggregationConfig, aggregate  # noqa: E402

ATTACKS: tuple[str, ...] = ("extreme", "sign_flip", "constant", "colluding", "inflated")
HARD_LIMIT = 1e4  # Settings.scalar_hard_limit's default: the largest |scalar| accepted


@dataclass(frozen=True)
class Recipe:
    lr: float = 4.0
    eps: float = 1e-3
    perturbations: int = 64
    batch: int = 16
    rounds: int = 150
    eval_every: int = 10
    bound: float = HARD_LIMIT


@dataclass(frozen=True)
class Rule:
    """A row of the benchmark: a name and the task's aggregation config."""

    name: str
    config: AggregationConfig = field(default_factory=AggregationConfig)


def default_rules(clip_bound: float) -> list[Rule]:
    base = AggregationConfig()
    return [
        Rule("mean", base),
        Rule("clipped_mean", replace(base, rule="clipped_mean", clip_bound=clip_bound)),
        Rule("trimmed_mean", replace(base, rule="trimmed_mean", trim=0.3)),
        Rule("median", replace(base, rule="median")),
        # Uniform weights (a cap of one example): a device's claim buys nothing.
        Rule("trimmed_mean_uniform", replace(base, rule="trimmed_mean", trim=0.3,
                                             max_num_examples=1)),
        Rule("median_uniform", replace(base, rule="median", max_num_examples=1)),
    ]


def load_features(args: argparse.Namespace) -> dict[str, Any]:
    """MiniLM features of the benchmark's split (the head sweep's cache), or synthetic ones."""
    if args.synthetic:
        return synthetic_features(args.devices, seed=0)
    from head_sweep import features  # noqa: I001 (benchmarks/ on sys.path)
    from sweep_data import FedConfig

    cache = args.cache or Path(f"runs/head_sweep_features_{args.train_pool}.pt")
    if args.data is None:
        raise SystemExit("--data (SST-2 train.tsv) is needed unless --synthetic")
    return features(cache, args.data, FedConfig(train_pool=args.train_pool),
                    args.model)


def synthetic_features(devices: int, seed: int, d: int = 32, n: int = 4000
                       ) -> dict[str, Any]:
    """A separable-with-noise two-class problem on the unit sphere, Dirichlet(0.5) devices:
    same shapes and the same code path as the MiniLM features, in a fraction of a second."""
    rng = np.random.default_rng([seed, 5])
    mu = rng.normal(size=d)
    mu /= np.linalg.norm(mu)

    def draw(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = rng.integers(0, 2, size=m)
        x = rng.normal(size=(m, d)) * 0.6 + np.where(y[:, None] == 1, mu, -mu) * 0.5
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return torch.from_numpy(x).float(), torch.from_numpy(y)

    px, py = draw(n)
    vx, vy = draw(1000)
    by_label = [np.flatnonzero(py.numpy() == c) for c in (0, 1)]
    parts: list[list[int]] = [[] for _ in range(devices)]
    for idx in by_label:
        share = rng.dirichlet([0.5] * devices)
        cuts = (np.cumsum(share)[:-1] * len(idx)).astype(int)
        for k, chunk in enumerate(np.split(rng.permutation(idx), cuts)):
            parts[k].extend(chunk.tolist())
    for k in range(devices):  # every device holds a few examples, as `carve` guarantees
        if len(parts[k]) < 4:
            parts[k].extend(rng.choice(n, size=4, replace=False).tolist())
    return {"pool_x": px, "pool_y": py, "val_x": vx, "val_y": vy,
            "parts": [np.array(sorted(p)) for p in parts],
            "w0": torch.zeros(2, d), "b0": torch.zeros(2)}


def batches(rng: np.random.Generator, parts: list[np.ndarray], batch: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every device's batch for a round as one padded [devices, batch] index matrix and its
    mask (a device smaller than the batch uses all its examples, as the trainer does)."""
    idx = np.zeros((len(parts), batch), dtype=np.int64)
    mask = np.zeros((len(parts), batch))
    for k, part in enumerate(parts):
        m = min(batch, len(part))
        idx[k, :m] = rng.choice(part, size=m, replace=False)
        mask[k, :m] = 1.0
    return torch.from_numpy(idx), torch.from_numpy(mask)


def fleet_losses(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor
                 ) -> torch.Tensor:
    """[devices, K] mean cross-entropy of each device's batch x [D, B, d] under K heads."""
    d = x.shape[-1]
    w = theta[:, : 2 * d].reshape(-1, 2, d)
    b = theta[:, 2 * d:]
    logits = torch.einsum("nbd,kcd->nkbc", x, w) + b[None, :, None, :]
    logp = torch.log_softmax(logits, dim=-1)
    nll = -torch.gather(logp, -1, y[:, None, :, None].expand(-1, logits.shape[1], -1, 1))[..., 0]
    return (nll * mask[:, None, :]).sum(-1) / mask.sum(-1)[:, None]


def evaluate(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    d = x.shape[1]
    logits = x @ theta[: 2 * d].reshape(2, d).T + theta[2 * d:]
    loss = float(torch.nn.functional.cross_entropy(logits, y))
    return loss, float((logits.argmax(1) == y).double().mean())


def alie_z(n: int, f: int) -> float:
    """z_max of "a little is enough": the largest shift that still looks like a majority."""
    from statistics import NormalDist

    s = math.floor(n / 2 + 1) - f
    return NormalDist().inv_cdf(min(max((n - s) / n, 0.5), 0.999))


def attack(name: str, g: np.ndarray, bad: np.ndarray, claimed: np.ndarray, cap: int,
           bound: float) -> tuple[np.ndarray, np.ndarray]:
    """(uploaded scalars, claimed num_examples) of the whole fleet under `name`."""
    g, claimed = g.copy(), claimed.copy()
    if not bad.any():
        return g, claimed
    honest = g[~bad]
    if name == "extreme":
        g[bad] = -np.sign(g[bad]) * bound
    elif name == "sign_flip":
        g[bad] = -g[bad]
    elif name == "constant":
        g[bad] = bound / 10
    elif name == "colluding":
        mu, sd = honest.mean(0), honest.std(0)
        g[bad] = mu - alie_z(len(g), int(bad.sum())) * sd * np.sign(mu)
    elif name == "inflated":
        g[bad] = -g[bad]
        claimed[bad] = cap
    else:
        raise ValueError(f"unknown attack {name!r}; choose from {ATTACKS}")
    return np.clip(g, -bound, bound), claimed


def simulate(f: dict[str, Any], recipe: Recipe, rule: Rule, attack_name: str,
             bad: np.ndarray, seed: int) -> dict[str, Any]:
    """One fleet run: validation (loss, accuracy) at version 0 and every eval_every rounds."""
    rng = np.random.default_rng([seed, 17])
    x, y, parts = f["pool_x"].double(), f["pool_y"], f["parts"]
    vx, vy = f["val_x"].double(), f["val_y"]
    theta = torch.cat([f["w0"].reshape(-1), f["b0"]]).double()
    sizes = np.array([len(p) for p in parts])
    cfg, r = rule.config, recipe
    curve = [(0, *evaluate(theta, vx, vy))]
    for i in range(1, r.rounds + 1):
        z = torch.from_numpy(rng.integers(0, 2, size=(r.perturbations, theta.numel())) * 2.0 - 1)
        plus, minus = theta + r.eps * z, theta - r.eps * z
        idx, mask = batches(rng, parts, r.batch)
        g = ((fleet_losses(plus, x[idx], y[idx], mask) - fleet_losses(minus, x[idx], y[idx],
                                                                      mask)) / (2 * r.eps))
        g = g.numpy()
        up, claimed = attack(attack_name, g, bad, sizes, cfg.max_num_examples, r.bound)
        weights = np.minimum(claimed, cfg.max_num_examples).astype(np.float64)
        agg = aggregate(up.astype(np.float32), weights, cfg)
        theta = theta - (r.lr / r.perturbations) * torch.from_numpy(agg) @ z
        if i % r.eval_every == 0 or i == r.rounds:
            curve.append((i, *evaluate(theta, vx, vy)))
    return {"rounds": [c[0] for c in curve], "val_loss": [c[1] for c in curve],
            "val_accuracy": [c[2] for c in curve]}


def honest_scale(f: dict[str, Any], recipe: Recipe) -> float:
    """Median |g| of honest version-0 estimates: the unit of a sensible clip bound."""
    rng = np.random.default_rng(3)
    theta = torch.cat([f["w0"].reshape(-1), f["b0"]]).double()
    z = torch.from_numpy(rng.integers(0, 2, size=(recipe.perturbations, theta.numel())) * 2.0 - 1)
    out = []
    for part in f["parts"]:
        idx = rng.choice(part, size=min(recipe.batch, len(part)), replace=False)
        xb, yb = f["pool_x"].double()[idx], f["pool_y"][idx]
        out.append((losses(theta + recipe.eps * z, xb, yb) - losses(theta - recipe.eps * z, xb,
                                                                    yb)) / (2 * recipe.eps))
    return float(torch.cat(out).abs().median())


def run_all(f: dict[str, Any], recipe: Recipe, rules: list[Rule], attacks: list[str],
            fractions: list[float], seeds: int, tolerance: float,
            log: bool = True) -> dict[str, Any]:
    n = len(f["parts"])
    rows: list[dict[str, Any]] = []
    for seed in range(seeds):
        order = np.random.default_rng([seed, 23]).permutation(n)  # nested attacker sets
        for rule in rules:
            t0 = time.perf_counter()
            clean = simulate(f, recipe, rule, "none", np.zeros(n, bool), seed)
            rows.append({"rule": rule.name, "attack": "none", "fraction": 0.0, "seed": seed,
                         **clean, "held": True})
            for name in attacks:
                for frac in fractions:
                    bad = np.zeros(n, bool)
                    bad[order[: int(round(frac * n))]] = True
                    res = simulate(f, recipe, rule, name, bad, seed)
                    held = (res["val_accuracy"][-1] >= clean["val_accuracy"][-1] - tolerance
                            and res["val_loss"][-1] <= res["val_loss"][0])
                    rows.append({"rule": rule.name, "attack": name, "fraction": frac,
                                 "seed": seed, "byzantine_devices": int(bad.sum()), **res,
                                 "held": bool(held)})
            if log:
                print(f"  seed {seed} {rule.name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return {"rows": rows, "rules": {r.name: vars(r.config) for r in rules}}


def table(result: dict[str, Any], attacks: list[str], fractions: list[float]) -> str:
    rows = result["rows"]
    head = f"{'rule':<22}{'clean':>7}" + "".join(
        f"{a[:9] + ' ' + format(fr, '.0%'):>15}" for a in attacks for fr in fractions)
    lines = [head]
    for rule in dict.fromkeys(r["rule"] for r in rows):
        def acc(a: str, fr: float, rule: str = rule) -> tuple[float, bool]:
            sel = [r for r in rows if r["rule"] == rule and r["attack"] == a
                   and r["fraction"] == fr]
            return (float(np.mean([r["val_accuracy"][-1] for r in sel])),
                    all(r["held"] for r in sel))
        cells = [f"{acc('none', 0.0)[0]:>7.3f}"]
        for a in attacks:
            for fr in fractions:
                v, held = acc(a, fr)
                cells.append(f"{v:>14.3f}{' ' if held else '!'}")
        lines.append(f"{rule:<22}" + "".join(cells))
    lines.append("(validation accuracy after the last round; ! = not held: more than the "
                 "tolerance under the clean fleet, or loss above version 0)")
    return "\n".join(lines)


def plot(result: dict[str, Any], attacks: list[str], fraction: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["seed"] == 0]
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    fig, axes = plt.subplots(2, len(attacks), figsize=(3.4 * len(attacks), 6.2), sharex=True,
                             squeeze=False)
    for j, a in enumerate(attacks):
        for rule in rules:
            sel = [r for r in rows if r["rule"] == rule and r["attack"] == a
                   and r["fraction"] == fraction]
            if not sel:
                continue
            axes[0][j].plot(sel[0]["rounds"], sel[0]["val_accuracy"], label=rule)
            axes[1][j].plot(sel[0]["rounds"], np.minimum(sel[0]["val_loss"], 2.0), label=rule)
        clean = [r for r in rows if r["rule"] == "mean" and r["attack"] == "none"]
        if clean:
            axes[0][j].plot(clean[0]["rounds"], clean[0]["val_accuracy"], "k:", label="clean mean")
        axes[0][j].set_title(f"{a}, {fraction:.0%} Byzantine")
        axes[0][j].set_ylim(0.3, 0.9)
        axes[1][j].set_xlabel("round")
    axes[0][0].set_ylabel("validation accuracy")
    axes[1][0].set_ylabel("validation loss (capped at 2)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--train-pool", type=int, default=8000)
    ap.add_argument("--synthetic", action="store_true",
                    help="synthetic features instead of MiniLM on SST-2 (tests, no model)")
    ap.add_argument("--devices", type=int, default=20, help="with --synthetic")
    ap.add_argument("--rounds", type=int, default=Recipe.rounds)
    ap.add_argument("--eval-every", type=int, default=Recipe.eval_every)
    ap.add_argument("--lr", type=float, default=Recipe.lr)
    ap.add_argument("--perturbations", type=int, default=Recipe.perturbations)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    ap.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    ap.add_argument("--rules", nargs="+", default=None,
                    help="subset of: mean clipped_mean trimmed_mean median "
                         "trimmed_mean_uniform median_uniform")
    ap.add_argument("--clip-bound", type=float, default=None,
                    help="clipped_mean's bound (default: 3 x the median honest |g| at v0)")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/byzantine.json"))
    ap.add_argument("--png", type=Path, default=Path("benchmarks/results/byzantine.png"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    f = load_features(args)
    recipe = Recipe(lr=args.lr, perturbations=args.perturbations, rounds=args.rounds,
                    eval_every=args.eval_every)
    scale = honest_scale(f, recipe)
    clip = args.clip_bound or 3.0 * scale
    rules = default_rules(clip)
    if args.rules:
        rules = [r for r in rules if r.name in args.rules]
    t0 = time.perf_counter()
    result = run_all(f, recipe, rules, args.attacks, args.fractions, args.seeds,
                     args.tolerance)
    result.update({
        "recipe": vars(recipe), "honest_median_abs_g": scale, "clip_bound": clip,
        "features": "synthetic" if args.synthetic else "MiniLM SST-2 (head_sweep cache)",
        "devices": len(f["parts"]), "seeds": args.seeds, "tolerance": args.tolerance,
        "wall_s": time.perf_counter() - t0, "cpus": os.cpu_count(),
        "held_at": {r.name: {f"{a}@{fr}": all(x["held"] for x in result["rows"]
                                              if x["rule"] == r.name and x["attack"] == a
                                              and x["fraction"] == fr)
                             for a in args.attacks for fr in args.fractions}
                    for r in rules},
    })
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(table(result, args.attacks, args.fractions))
    print(f"clip bound {clip:.3g} (3 x median honest |g| = {scale:.3g}); "
          f"{result['wall_s']:.0f} s; JSON {args.json}")
    try:
        plot(result, args.attacks, max(args.fractions), args.png)
        print(f"curves at {max(args.fractions):.0%}: {args.png}")
    except ImportError:
        print("matplotlib missing: no PNG")
    return result


if __name__ == "__main__":
    main()
