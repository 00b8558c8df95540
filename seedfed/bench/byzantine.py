"""Byzantine fleets: how each aggregation rule trains when 10-30% of the devices lie.

The SST-2 head recipe (`--recipe sst2`: MiniLM head scope, lr 32 on a cosine to a
tenth over 300 rounds, the bias's step scale 0.1, eps 1e-3, one step of P = 512 perturbations,
batch 16, all 20 Dirichlet(0.5) devices every round) run on cached sentence embeddings, as
`seedfed.bench.head_sweep` does: same split and partition (`carve`), Rademacher z, two-point
estimates, coef = -(lr / P) * AGG_d g_d. AGG is the coordinator's own
`seedfed.shared.protocol.aggregate.aggregate` with the coordinator's weights
(`seedfed.shared.protocol.aggregate.round_weights` of the claimed example counts) and each
round's lr from the recipe's own schedule (`Hyper.lr_of_round`). z and batches come from numpy
generators, not the Philox stream (same distribution, not the same bits). The head is a
two-class linear model, so each probe's loss is computed from the logit margin in closed form.

A fraction of the devices (the same devices for every rule, nested: the 10% are among the 20%)
replace their honest estimate g_d (and, where said, their example count) with:

    extreme     -sign(g_d) * B: the largest magnitude the coordinator accepts (B = the hard
                limit, `Settings.scalar_hard_limit`), against their own gradient estimate
    opposite    -sign(mu) * B: the same, against the honest devices' mean (omniscient)
    sign_flip   -g_d (honest magnitude, wrong direction)
    constant    +B/10 for every seed (a stuck or scripted device)
    colluding   all send mu - z_max * sigma * sign(mu) per seed, from the honest devices' mean
                and spread ("a little is enough", Baruch et al. 2019): inside the honest
                spread, so trimming and medians do not see it as an outlier
    ipm         all send -0.5 * mu ("inner product manipulation", Xie et al. 2020): small,
                inside the spread, against the mean
    minmax      all send mu - gamma * sign(mu) with the largest gamma that keeps them no
                farther from any honest device than two honest devices are from each other
                (Shejwalkar and Houmansadr 2021): inside the spread in distance
    edge        each sends an honest device's vector with its component along the honest
                mean's direction set to the low edge of the honest projections (median - 2
                MADs): inside the spread along the one direction that moves training
    inflated    -g_d, each claiming num_examples = 2**31 - 1 (the largest count the wire
                accepts), to buy the weight
    colluding_claims  colluding's values, each claiming 2**31 - 1

Rules (the rows; `--rules` picks some): the coordinator's rules with their default
configuration (`mean`, which is the default; `trimmed_mean` at trim 0.3; `median`),
`clipped_mean` at 3 x the median honest |g| at version 0, `mean_nk` (FedAvg's plain example
weights: what the default's weight cap costs on a clean fleet), and `oracle`, the default mean
over the honest devices alone: no rule can do better than knowing who lies. With `--rules`,
two aggregators of the literature the coordinator does not offer: `sign_vote` (FeedSign's
majority of signs) and `krum` (sized for 30% liars).

Output: per rule, attack and fraction, validation loss and accuracy every `--eval-every`
rounds (JSON), a PNG of the curves at the largest fraction, and a table of final accuracies.
A cell is marked `!` where it misses the target of docs/reliability.md section 5: at 20% or
fewer liars, at least 90% of the rule's clean gain over version 0; at 30%, above version 0 and
within 3 points of the rule's clean run.

    nice seedfed bench byzantine --data train.tsv     # ~25 min on one core
    seedfed bench byzantine --synthetic --rounds 40   # no model: synthetic features
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seedfed.bench.registry import RESULTS, bench_parser
from seedfed.bench.report import write_json
from seedfed.shared.protocol.aggregate import AggregationConfig, aggregate, round_weights
from seedfed.shared.protocol.recipes import HEAD_STEP_SCALES, SST2_HYPER
from seedfed.shared.protocol.task import Hyper
from seedfed.shared.protocol.wire import MAX_NUM_EXAMPLES

ATTACKS: tuple[str, ...] = ("extreme", "opposite", "sign_flip", "constant", "colluding", "ipm",
                            "minmax", "edge", "inflated", "colluding_claims")
HARD_LIMIT = 1e4  # Settings.scalar_hard_limit's default: the largest |scalar| accepted


@dataclass(frozen=True)
class Recipe:
    """The fleet's ZO settings: the SST-2 head recipe's (lr schedule included) by default."""

    hyper: Hyper = SST2_HYPER
    rounds: int = 300
    eval_every: int = 10
    bias_scale: float = dict(HEAD_STEP_SCALES)["classifier.bias"]
    bound: float = HARD_LIMIT


@dataclass(frozen=True)
class Rule:
    """A row of the benchmark: a name and the task's aggregation config (`oracle`: the config
    applied to the honest devices alone; `anchor`: an aggregator from the literature that the
    coordinator does not offer, measured for comparison, see `ANCHORS`)."""

    name: str
    config: AggregationConfig = field(default_factory=AggregationConfig)
    oracle: bool = False
    anchor: str | None = None


def sign_vote(g: np.ndarray) -> np.ndarray:
    """FeedSign-style (Wang et al. 2024): each device votes the sign of its scalar, the seed
    moves by the majority sign times the round's median |g| (a step of the honest size)."""
    return np.sign(np.sign(g).sum(0)) * float(np.median(np.abs(g)))


def krum(g: np.ndarray, f: int) -> np.ndarray:
    """Krum (Blanchard et al. 2017): the one device vector with the smallest sum of squared
    distances to its n - f - 2 nearest others (f: the liars it is sized for)."""
    sq = (g ** 2).sum(1)
    dist = np.maximum(sq[:, None] + sq[None] - 2 * g @ g.T, 0.0)
    near = max(1, len(g) - f - 2)
    scores = [np.sort(np.delete(dist[i], i))[:near].sum() for i in range(len(g))]
    return g[int(np.argmin(scores))]


#: Aggregators measured beside the coordinator's rules (benchmark only; uniform weights).
ANCHORS = {"sign_vote": lambda g: sign_vote(g),
           "krum": lambda g: krum(g, int(round(0.3 * len(g))))}


def default_rules(clip_bound: float) -> list[Rule]:
    base = AggregationConfig()
    return [
        Rule("mean", base),
        Rule("mean_nk", replace(base, max_weight_ratio=None)),
        Rule("clipped_mean", replace(base, rule="clipped_mean", clip_bound=clip_bound)),
        Rule("trimmed_mean", replace(base, rule="trimmed_mean", trim=0.3)),
        Rule("median", replace(base, rule="median")),
        Rule("oracle", base, oracle=True),
        Rule("sign_vote", base, anchor="sign_vote"),
        Rule("krum", base, anchor="krum"),
    ]


def load_features(args: argparse.Namespace) -> dict[str, Any]:
    """MiniLM features of the benchmark's split (the head sweep's cache), or synthetic ones."""
    if args.synthetic:
        return synthetic_features(args.devices, seed=0)
    from seedfed.bench.head_sweep import features
    from seedfed.bench.sweep_data import FedConfig

    cache = args.cache or Path(f"runs/head_sweep_features_{args.train_pool}.pt")
    if args.data is None and not cache.exists():
        raise SystemExit("--data (SST-2 train.tsv) is needed unless --synthetic or a cache "
                         f"at {cache}")
    return features(cache, args.data, FedConfig(train_pool=args.train_pool), args.model)


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


def two_point(theta: torch.Tensor, z: torch.Tensor, eps: float, x: torch.Tensor,
              y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[devices, K] two-point estimates (L(theta + eps z_k) - L(theta - eps z_k)) / (2 eps) of
    each device's mean cross-entropy over its batch x [D, B, d]. The head is two-class and
    linear, so the loss is softplus(-s m) of the margin m = logit_1 - logit_0 (s = +-1 by the
    label), and a probe moves the margin by eps * (x . (z_w1 - z_w0) + z_b1 - z_b0): one
    [D, B, K] product for all probes instead of two [D, K, B, 2] ones."""
    d = x.shape[-1]
    w, b = theta[: 2 * d].reshape(2, d), theta[2 * d:]
    margin = x @ (w[1] - w[0]) + (b[1] - b[0])
    dz = torch.einsum("nbd,kd->nbk", x, z[:, d: 2 * d] - z[:, :d]) + (z[:, 2 * d + 1]
                                                                       - z[:, 2 * d])
    s = (2 * y - 1).to(x.dtype)[..., None]
    plus = torch.nn.functional.softplus(-s * (margin[..., None] + eps * dz))
    minus = torch.nn.functional.softplus(-s * (margin[..., None] - eps * dz))
    return ((plus - minus) * mask[..., None]).sum(1) / mask.sum(-1)[:, None] / (2 * eps)


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


def _minmax(honest: np.ndarray) -> np.ndarray:
    """mu - gamma sign(mu), gamma the largest keeping it within the honest pairwise reach."""
    mu, direction = honest.mean(0), -np.sign(honest.mean(0))
    sq = (honest ** 2).sum(1)
    reach = float(np.sqrt(np.maximum(sq[:, None] + sq[None] - 2 * honest @ honest.T, 0).max()))
    lo, hi = 0.0, 2 * reach / max(float(np.linalg.norm(direction)), 1e-300)
    for _ in range(50):  # bisection on gamma
        gamma = (lo + hi) / 2
        far = np.linalg.norm(honest - (mu + gamma * direction), axis=1).max()
        lo, hi = (gamma, hi) if far <= reach else (lo, gamma)
    return mu + lo * direction


def _edge(honest: np.ndarray, m: int) -> np.ndarray:
    """m honest vectors with their component along the honest mean at its low edge."""
    u = honest.mean(0) / max(float(np.linalg.norm(honest.mean(0))), 1e-300)
    p = honest @ u
    med = float(np.median(p))
    low = med - 2 * 1.4826 * float(np.median(np.abs(p - med)))
    src = honest[np.arange(m) % len(honest)]
    return src - np.outer(src @ u - low, u)


def attack(name: str, g: np.ndarray, bad: np.ndarray, claimed: np.ndarray, bound: float
           ) -> tuple[np.ndarray, np.ndarray]:
    """(uploaded scalars, claimed num_examples) of the whole fleet under `name`."""
    g, claimed = g.copy(), claimed.copy()
    m = int(bad.sum())
    if m == 0:
        return g, claimed
    honest = g[~bad]
    mu = honest.mean(0)
    if name == "extreme":
        g[bad] = -np.sign(g[bad]) * bound
    elif name == "opposite":
        g[bad] = -np.sign(mu) * bound
    elif name in ("sign_flip", "inflated"):
        g[bad] = -g[bad]
    elif name == "constant":
        g[bad] = bound / 10
    elif name in ("colluding", "colluding_claims"):
        g[bad] = mu - alie_z(len(g), m) * honest.std(0) * np.sign(mu)
    elif name == "ipm":
        g[bad] = -0.5 * mu
    elif name == "minmax":
        g[bad] = _minmax(honest)
    elif name == "edge":
        g[bad] = _edge(honest, m)
    else:
        raise ValueError(f"unknown attack {name!r}; choose from {ATTACKS}")
    if name in ("inflated", "colluding_claims"):
        claimed[bad] = MAX_NUM_EXAMPLES
    return np.clip(g, -bound, bound), claimed


def simulate(f: dict[str, Any], recipe: Recipe, rule: Rule, attack_name: str,
             bad: np.ndarray, seed: int) -> dict[str, Any]:
    """One fleet run: validation (loss, accuracy) at version 0 and every eval_every rounds,
    the liars' share of the aggregation weight, and each device's agreement: the cosine of
    its upload with the round's aggregate (both means over the rounds; what a reputation
    across rounds would see)."""
    rng = np.random.default_rng([seed, 17])
    x, y, parts = f["pool_x"].double(), f["pool_y"], f["parts"]
    vx, vy = f["val_x"].double(), f["val_y"]
    theta = torch.cat([f["w0"].reshape(-1), f["b0"]]).double()
    d = x.shape[1]
    scale = torch.ones(theta.numel(), dtype=torch.float64)
    scale[2 * d:] = recipe.bias_scale  # c_t of the bias: its probes and steps
    sizes = np.array([len(p) for p in parts])
    h, cfg = recipe.hyper, rule.config
    curve = [(0, *evaluate(theta, vx, vy))]
    shares, agreement = [], np.zeros(len(parts))
    for i in range(1, recipe.rounds + 1):
        z = torch.from_numpy(rng.integers(0, 2, size=(h.perturbations, theta.numel())) * 2.0
                             - 1) * scale
        idx, mask = batches(rng, parts, h.batch_size)
        g = two_point(theta, z, h.eps, x[idx], y[idx], mask).numpy()
        up, claimed = attack(attack_name, g.astype(np.float32).astype(np.float64), bad,
                             sizes, recipe.bound)
        keep = ~bad if rule.oracle else np.ones(len(up), bool)
        w = round_weights(claimed[keep], cfg)
        shares.append(float(w[bad[keep]].sum() / w.sum()))
        agg = ANCHORS[rule.anchor](up) if rule.anchor else aggregate(up[keep], w, cfg)
        agreement += up @ agg / np.maximum(np.linalg.norm(up, axis=1) * np.linalg.norm(agg),
                                           1e-300)
        theta = theta - (h.lr_of_round(i) / h.perturbations) * torch.from_numpy(agg) @ z
        if i % recipe.eval_every == 0 or i == recipe.rounds:
            curve.append((i, *evaluate(theta, vx, vy)))
    return {"rounds": [c[0] for c in curve], "val_loss": [c[1] for c in curve],
            "val_accuracy": [c[2] for c in curve], "liar_weight_share": float(np.mean(shares)),
            "agreement": (agreement / recipe.rounds).tolist(),
            "liars": np.flatnonzero(bad).tolist()}


def honest_scale(f: dict[str, Any], recipe: Recipe) -> float:
    """Median |g| of honest version-0 estimates: the unit of a sensible clip bound."""
    rng = np.random.default_rng(3)
    theta = torch.cat([f["w0"].reshape(-1), f["b0"]]).double()
    h = recipe.hyper
    z = torch.from_numpy(rng.integers(0, 2, size=(h.perturbations, theta.numel())) * 2.0 - 1)
    idx, mask = batches(rng, f["parts"], h.batch_size)
    g = two_point(theta, z, h.eps, f["pool_x"].double()[idx], f["pool_y"][idx], mask)
    return float(g.abs().median())


def target_met(acc: float, v0: float, clean: float, fraction: float) -> bool:
    """docs/reliability.md section 5: <= 20% liars keep >= 90% of the clean gain over
    version 0; 30% (and more) stay above version 0 and within 3 points of clean."""
    if fraction <= 0.2 + 1e-9:
        return acc - v0 >= 0.9 * (clean - v0)
    return acc > v0 and acc >= clean - 0.03


def run_all(f: dict[str, Any], recipe: Recipe, rules: list[Rule], attacks: list[str],
            fractions: list[float], seeds: int, log: bool = True) -> dict[str, Any]:
    n = len(f["parts"])
    rows: list[dict[str, Any]] = []
    for seed in range(seeds):
        order = np.random.default_rng([seed, 23]).permutation(n)  # nested attacker sets
        for rule in rules:
            t0 = time.perf_counter()
            clean = simulate(f, recipe, rule, "none", np.zeros(n, bool), seed)
            v0, top = clean["val_accuracy"][0], clean["val_accuracy"][-1]
            rows.append({"rule": rule.name, "attack": "none", "fraction": 0.0, "seed": seed,
                         **clean, "target_met": True})
            for name in attacks:
                for frac in fractions:
                    bad = np.zeros(n, bool)
                    bad[order[: int(round(frac * n))]] = True
                    res = simulate(f, recipe, rule, name, bad, seed)
                    rows.append({"rule": rule.name, "attack": name, "fraction": frac,
                                 "seed": seed, "byzantine_devices": int(bad.sum()), **res,
                                 "target_met": target_met(res["val_accuracy"][-1], v0, top,
                                                          frac)})
            if log:
                print(f"  seed {seed} {rule.name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return {"rows": rows, "rules": {r.name: {**vars(r.config), "oracle": r.oracle}
                                    for r in rules}}


def table(result: dict[str, Any], attacks: list[str], fractions: list[float]) -> str:
    rows = result["rows"]
    head = f"{'rule':<14}{'v0':>6}{'clean':>7}" + "".join(
        f"{a[:10] + ' ' + format(fr, '.0%'):>15}" for a in attacks for fr in fractions)
    lines = [head]
    for rule in dict.fromkeys(r["rule"] for r in rows):
        def cell(a: str, fr: float, rule: str = rule) -> tuple[float, bool]:
            sel = [r for r in rows if r["rule"] == rule and r["attack"] == a
                   and r["fraction"] == fr]
            return (float(np.mean([r["val_accuracy"][-1] for r in sel])),
                    all(r["target_met"] for r in sel))
        v0 = float(np.mean([r["val_accuracy"][0] for r in rows if r["rule"] == rule]))
        cells = [f"{v0:>6.3f}{cell('none', 0.0)[0]:>7.3f}"]
        for a in attacks:
            for fr in fractions:
                v, met = cell(a, fr)
                cells.append(f"{v:>14.3f}{' ' if met else '!'}")
        lines.append(f"{rule:<14}" + "".join(cells))
    lines.append("(validation accuracy after the last round; ! = target missed: <= 20% liars "
                 "keep >= 90% of the rule's clean gain over v0, 30% stay above v0 and within "
                 "3 points of clean)")
    return "\n".join(lines)


def plot(result: dict[str, Any], attacks: list[str], fraction: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["seed"] == 0]
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    cols = min(5, len(attacks))
    grid = math.ceil(len(attacks) / cols)
    fig, axes = plt.subplots(grid, cols, figsize=(3.4 * cols, 3.0 * grid), sharex=True,
                             sharey=True, squeeze=False)
    for j, a in enumerate(attacks):
        ax = axes[j // cols][j % cols]
        for rule in rules:
            sel = [r for r in rows if r["rule"] == rule and r["attack"] == a
                   and r["fraction"] == fraction]
            if sel:
                ax.plot(sel[0]["rounds"], sel[0]["val_accuracy"], label=rule)
        clean = [r for r in rows if r["rule"] == "mean" and r["attack"] == "none"]
        if clean:
            ax.plot(clean[0]["rounds"], clean[0]["val_accuracy"], "k:", label="clean mean")
        ax.set_title(f"{a}, {fraction:.0%} liars", fontsize=9)
        ax.set_ylim(0.4, 0.9)
    for ax in axes[-1]:
        ax.set_xlabel("round")
    for row in axes:
        row[0].set_ylabel("validation accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("byzantine")
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--train-pool", type=int, default=8000)
    ap.add_argument("--synthetic", action="store_true",
                    help="synthetic features instead of MiniLM on SST-2 (tests, no model)")
    ap.add_argument("--devices", type=int, default=20, help="with --synthetic")
    ap.add_argument("--rounds", type=int, default=Recipe.rounds,
                    help="rounds (the lr decays over min(rounds, the recipe's decay_rounds))")
    ap.add_argument("--eval-every", type=int, default=Recipe.eval_every)
    ap.add_argument("--perturbations", type=int, default=SST2_HYPER.perturbations)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    ap.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    ap.add_argument("--rules", nargs="+", default=None,
                    help="subset of: mean mean_nk clipped_mean trimmed_mean median oracle "
                         "sign_vote krum (default: all but the last two, the literature's "
                         "anchors)")
    ap.add_argument("--clip-bound", type=float, default=None,
                    help="clipped_mean's bound (default: 3 x the median honest |g| at v0)")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=RESULTS / "byzantine.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "byzantine.png")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    f = load_features(args)
    decay = min(args.rounds, SST2_HYPER.decay_rounds or args.rounds)
    recipe = Recipe(hyper=replace(SST2_HYPER, perturbations=args.perturbations,
                                  decay_rounds=decay),
                    rounds=args.rounds, eval_every=args.eval_every)
    scale = honest_scale(f, recipe)
    clip = args.clip_bound or 3.0 * scale
    rules = default_rules(clip)
    rules = [r for r in rules if r.name in args.rules] if args.rules else \
        [r for r in rules if r.anchor is None]
    t0 = time.perf_counter()
    result = run_all(f, recipe, rules, args.attacks, args.fractions, args.seeds)
    result.update({
        "recipe": {**vars(recipe.hyper), "rounds": recipe.rounds, "bias_scale":
                   recipe.bias_scale, "bound": recipe.bound},
        "honest_median_abs_g": scale, "clip_bound": clip,
        "features": "synthetic" if args.synthetic else "MiniLM SST-2 (head_sweep cache)",
        "devices": len(f["parts"]), "device_examples": [len(p) for p in f["parts"]],
        "seeds": args.seeds, "wall_s": time.perf_counter() - t0, "cpus": os.cpu_count(),
        "target_met": {r.name: {f"{a}@{fr}": all(x["target_met"] for x in result["rows"]
                                                 if x["rule"] == r.name and x["attack"] == a
                                                 and x["fraction"] == fr)
                                for a in args.attacks for fr in args.fractions}
                       for r in rules},
    })
    write_json(args.json, result, indent=1, newline=False)
    print(table(result, args.attacks, args.fractions))
    print(f"clip bound {clip:.3g} (3 x median honest |g| = {scale:.3g}); "
          f"{result['wall_s']:.0f} s; JSON {args.json}")
    try:
        plot(result, args.attacks, max(args.fractions), args.png)
        print(f"curves at {max(args.fractions):.0%}: {args.png}")
    except ImportError:
        print("matplotlib missing: no PNG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
