"""How fast can ZO move a body scope? Gradient coherence and curvature at the head's optimum.

`body_sweep.py fo` measures what a scope could reach (its first-order ceiling); this script
measures how fast SPSA could get there, from the same cache and at the point the fleet starts
its body from: the head recipe's trained head, the body as pretrained (LoRA B = 0).

For a scope's trained tensors theta (d numbers) on the fleet's pool (the union of the 20
devices' examples, the loss the fleet minimizes), with g = the pool's gradient, g_i one
example's gradient, F = mean_i g_i g_i^T (empirical Fisher) and G = the Gauss-Newton matrix
(mean_i p_i (1 - p_i) j_i j_i^T, j_i the gradient of the logit margin; the PSD part of the
Hessian that the loss's curvature along random directions sees):

- A two-point probe along z (Rademacher) returns s = z.g_B for the batch B of a round.
  E[s z] = g, so the step -lr s z descends on average, but its square E[s^2 z^T G z] ~=
  E|g_B|^2 tr(H) grows with the dimension through tr(H). Minimizing the quadratic model
  over lr gives the best expected loss decrease one seed can buy:

      r = |g|^4 / (2 E|g_B|^2 tr(H)),   E|g_B|^2 = |g|^2 + (tr(F) - |g|^2) / |B|

  (`|B|` = the round's effective batch: 20 devices x 16 examples, each device's mean weighted
  by its n_k, Kish's effective size ~145 for the benchmark's Dirichlet partition; seeds of a
  round add their decreases while P << d). tr(G) is measured beside tr(H) (Hutchinson, central
  second differences in float64) and the larger of the two is used: a LayerNorm or a normalized
  pooling between a tensor and the loss adds curvature the Gauss-Newton part does not see.
  `coherence` = |g|^2 / tr(F): the fraction of one example's gradient energy that is shared
  signal; below 1 / |B| a round's batch gradient is mostly noise.
- `seeds_per_0.01` = 0.01 / r: seeds for the loss to fall 0.01 nats at the starting rate
  (optimistic: the rate only falls as g shrinks). `min_per_0.01` multiplies by the measured
  cost of a probe pair over the round's 320 sentences through this script's functional layers
  from the cached layer entry (an upper bound for scopes at the top of layer 5, whose probes
  the engine runs from a shared pre-LayerNorm state: `seedfed bench probes` has those costs).
- The head at version 0 (the prototype head, before any training) is the calibration: the
  shipped head recipe takes it to its optimum in 300 rounds x 512 seeds.

    seedfed bench body_coherence --data PATH/sst2/train.tsv --head runs/head_recipe.pt \
        --scopes head ln5out ffo5 lnb5 lora5 fa5 top1 top2 full \
        --json benchmarks/results/body_coherence.json

`--head` is the flat head `body_sweep.py zo --scope head ... --save-head` writes.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from seedfed.bench.body_sweep import Split, forward, load_cache, scope_names
from seedfed.bench.registry import bench_parser
from seedfed.bench.report import write_json

ROUND_BATCH = 320  # 20 devices x 16 sentences
DEVICE_BATCH = 16
HEAD = ("classifier.weight", "classifier.bias")


def scope_point(cache: dict[str, Any], scope: str, head: torch.Tensor | None
                ) -> tuple[dict[str, torch.Tensor], list[str], int, dict[str, torch.Tensor]]:
    """(params at the starting point, names of the tensors measured, start layer, LoRA)."""
    params = {k: v.clone() for k, v in cache["params"].items()}
    if head is not None:
        w = params["classifier.weight"]
        params["classifier.weight"] = head[:w.numel()].view_as(w).clone()
        params["classifier.bias"] = head[w.numel():].clone()
    names, start, rank = scope_names(scope, params)
    lora: dict[str, torch.Tensor] = {}
    if rank:  # A as body_sweep's ZoProblem draws it; B = 0 (version 0 of an adapter)
        g = torch.Generator().manual_seed(12345)
        lora = {"5.A": (torch.rand(1536, rank, generator=g) * 2 - 1) / math.sqrt(1536),
                "5.B": torch.zeros(rank, 384)}
    # the body part alone (block seeds keep the head's directions out of the body's scalars)
    body = [n for n in names if n not in HEAD] + (["5.A"] if scope == "lora5" else []) + (
        ["5.B"] if lora else [])
    return params, (body or list(HEAD)), start, lora


def _leaves(params: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], names: list[str]
            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[torch.Tensor]]:
    p = {k: (v.detach().requires_grad_(True) if k in names else v) for k, v in params.items()}
    lo = {k: (v.detach().requires_grad_(True) if k in names else v) for k, v in lora.items()}
    return p, lo, [p[n] if n in p else lo[n] for n in names]


def pool_gradient(cache: dict[str, Any], params: dict[str, torch.Tensor],
                  lora: dict[str, torch.Tensor], names: list[str], start: int
                  ) -> tuple[float, torch.Tensor]:
    """(mean loss, its gradient) over the fleet's whole pool, in length-sorted batches."""
    pool = Split(cache["pool"])
    union = torch.from_numpy(np.sort(np.concatenate(cache["parts"])))
    p, lo, leaves = _leaves(params, lora, names)
    total, grads = 0.0, [torch.zeros_like(t) for t in leaves]
    order = union[torch.argsort(pool.lengths[union])]  # similar lengths: little padding
    for idx in torch.split(order, 64):
        loss = F.cross_entropy(forward(p, pool, idx, start, lo or None), pool.y[idx],
                               reduction="sum")
        for acc, gr in zip(grads, torch.autograd.grad(loss, leaves), strict=True):
            acc += gr
        total += float(loss.detach())
    n = len(union)
    return total / n, torch.cat([gr.reshape(-1) for gr in grads]) / n


def example_moments(cache: dict[str, Any], params: dict[str, torch.Tensor],
                    lora: dict[str, torch.Tensor], names: list[str], start: int, sample: int
                    ) -> tuple[float, float]:
    """(tr F, tr G) from per-example margin gradients of `sample` random pool examples."""
    pool = Split(cache["pool"])
    union = torch.from_numpy(np.sort(np.concatenate(cache["parts"])))
    pick = union[torch.randperm(len(union), generator=torch.Generator().manual_seed(1))[:sample]]
    p, lo, leaves = _leaves(params, lora, names)
    tr_f = tr_g = 0.0
    for i in pick.tolist():
        idx = torch.tensor([i])
        logits = forward(p, pool, idx, start, lo or None)[0]
        margin = logits[1] - logits[0]
        j2 = sum(float((gr * gr).sum()) for gr in torch.autograd.grad(margin, leaves))
        prob1 = float(torch.sigmoid(margin.detach()))
        resid = prob1 - float(pool.y[i])  # d loss / d margin
        tr_f += resid * resid * j2
        tr_g += prob1 * (1.0 - prob1) * j2
    return tr_f / len(pick), tr_g / len(pick)


def effective_batch(parts: list[np.ndarray]) -> float:
    """Kish's effective sample size of a round's batch: each device's mean over its (up to) 16
    examples, weighted by its n_k. Dirichlet-skewed n_k make it well under the 320 examples."""
    n = np.array([len(p) for p in parts], dtype=float)
    b = np.minimum(DEVICE_BATCH, n)
    w = np.repeat(n / b, b.astype(int))
    return float(w.sum() ** 2 / (w * w).sum())


def hessian_trace(cache: dict[str, Any], params: dict[str, torch.Tensor],
                  lora: dict[str, torch.Tensor], names: list[str], start: int, sample: int,
                  tr_g: float, draws: int) -> float:
    """tr H by Hutchinson with central second differences along Rademacher z, on `sample` pool
    examples: E_z[(L(t + e z) + L(t - e z) - 2 L(t)) / e^2] = tr H, the curvature a two-point
    probe's step actually meets (the Gauss-Newton part plus the residual's, which a LayerNorm
    or a normalized pooling between the tensor and the loss can make large)."""
    pool = Split(cache["pool"])
    union = torch.from_numpy(np.sort(np.concatenate(cache["parts"])))
    pick = union[torch.randperm(len(union), generator=torch.Generator().manual_seed(3))[:sample]]
    p64 = {k: v.double() for k, v in params.items()}
    lo64 = {k: v.double() for k, v in lora.items()}
    shapes = {n: t.shape for n, t in (p64 | lo64).items()}
    eps = 1e-2 / math.sqrt(max(tr_g, 1e-12))  # eps^2 tr H ~ 1e-4: far above float64's noise
    gen = torch.Generator().manual_seed(4)

    def loss(shift: dict[str, torch.Tensor]) -> float:
        p = {k: v + shift[k] if k in shift else v for k, v in p64.items()}
        lo = {k: v + shift[k] if k in shift else v for k, v in lo64.items()}
        total = 0.0
        for s in range(0, len(pick), 64):
            idx = pick[s:s + 64]
            total += float(F.cross_entropy(forward(p, pool, idx, start, lo or None, torch.float64),
                                           pool.y[idx], reduction="sum"))
        return total / len(pick)

    with torch.no_grad():
        base = loss({})
        traces = []
        for _ in range(draws):
            z = {n: (torch.randint(0, 2, shapes[n], generator=gen) * 2 - 1).double()
                 for n in names}
            plus = loss({n: eps * v for n, v in z.items()})
            minus = loss({n: -eps * v for n, v in z.items()})
            traces.append((plus + minus - 2 * base) / eps**2)
    return float(np.mean(traces))


def probe_ms(cache: dict[str, Any], params: dict[str, torch.Tensor],
             lora: dict[str, torch.Tensor], start: int, repeats: int = 5) -> float:
    """One probe pair over a round's 320 sentences (20 batches of 16), from the cached prefix."""
    pool = Split(cache["pool"])
    idx = torch.randperm(len(pool), generator=torch.Generator().manual_seed(2))[:ROUND_BATCH]
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t = time.perf_counter()
            for _pm in range(2):
                for b in range(0, ROUND_BATCH, 16):
                    forward(params, pool, idx[b:b + 16], start, lora or None)
            times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def measure(cache: dict[str, Any], scope: str, head: torch.Tensor | None, sample: int,
            draws: int, label: str) -> dict[str, Any]:
    started = time.perf_counter()
    params, names, start, lora = scope_point(cache, scope, head)
    loss, g = pool_gradient(cache, params, lora, names, start)
    tr_f, tr_g = example_moments(cache, params, lora, names, start, sample)
    tr_h = hessian_trace(cache, params, lora, names, start, sample, tr_g, draws)
    g2 = float(g @ g)
    ess = effective_batch(cache["parts"])
    gb2 = g2 + (tr_f - g2) / ess
    curvature = max(tr_h, tr_g)  # a step pays the larger; tr H < tr G only by sampling noise
    rate = g2 * g2 / (2 * gb2 * curvature) if curvature > 0 and gb2 > 0 else 0.0
    ms = probe_ms(cache, params, lora, start)
    seeds = 0.01 / rate if rate > 0 else math.inf
    row = {"scope": scope, "point": label, "d": int(g.numel()), "start_layer": start,
           "loss": loss, "grad_sq": g2, "tr_fisher": tr_f, "tr_gauss_newton": tr_g,
           "tr_hessian": tr_h, "effective_batch": ess,
           "coherence": g2 / tr_f if tr_f else 0.0, "rate_per_seed": rate,
           "seeds_per_0.01": seeds, "ms_per_probe_pair_320": ms,
           "min_per_0.01": seeds * ms / 60000, "seconds": time.perf_counter() - started}
    print(f"{scope:8s} {label:9s} d {row['d']:8d} loss {loss:.4f} |g|^2 {g2:.3e} trF {tr_f:.3e} "
          f"trG {tr_g:.3e} trH {tr_h:.3e} coherence {row['coherence']:.2e} r/seed {rate:.2e} "
          f"seeds/0.01 {seeds:.2e} probe pair {ms:.0f} ms -> {row['min_per_0.01']:.3g} min "
          f"({row['seconds']:.0f} s)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("body_coherence")
    ap.add_argument("--data", type=Path, required=True, help="SST-2 train.tsv (label, sentence)")
    ap.add_argument("--head", type=Path, required=True, help="flat trained head (--save-head)")
    ap.add_argument("--scopes", nargs="+", default=["head", "ln5out", "ffo5", "lnb5", "top1"])
    ap.add_argument("--cache-dir", type=Path, default=Path("runs"))
    ap.add_argument("--format", default="fp32", choices=["fp32", "int8", "int4"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sample", type=int, default=512, help="examples for tr F and tr G")
    ap.add_argument("--draws", type=int, default=8, help="Rademacher draws for tr H")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = load_cache(args.format, args.cache_dir, args.data, args.model)
    head = torch.load(args.head)
    rows = [measure(cache, "head", None, args.sample, args.draws, "version0")]
    rows += [measure(cache, s, head, args.sample, args.draws, "trained") for s in args.scopes]
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
